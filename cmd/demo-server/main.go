// Command demo-server is the storm lab's payment gateway: a gRPC server on
// 127.0.0.1 that injects faults and counts every attempt it receives, first
// attempts and retries apart, by arrival time.
//
//	demo-server -addr 127.0.0.1:0 -fail-rate 0.3
//	demo-server -capacity 150 -recover-after 500ms
//	demo-server -capacity 80 -model gentle -trigger-at 3s -trigger-for 2s -trigger-capacity 30
//	demo-server -otlp 127.0.0.1:4317
//
// With -otlp, every call to the gateway is traced with otelgrpc's server
// handler, under the trace context the client sent (W3C Trace Context),
// and exported as service "demo-server" (OTEL_SERVICE_NAME overrides it).
//
// The client may replace the faults at each reset (the ResetStats call).
//
// With -tier it is instead a tier of the mesh lab (demo-client -mesh): it
// forwards every charge to -next through the client that the mesh strategy
// -mesh-strategy gives hop -hop, with the request's deadline, and answers
// with what came back, the status code kept:
//
//	demo-server -tier -next 127.0.0.1:7001 -mesh-strategy "herdguard + server half" -hop 3 -scale 2 -addr-file f
//
// A tier with -otlp traces what it serves and what it sends on, as service
// "gateway" (-hop 2) or "service" (-hop 3), continuing the caller's trace.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

func main() {
	log.SetFlags(0)
	log.SetPrefix("demo-server: ")
	var (
		addr     = flag.String("addr", "127.0.0.1:0", "listen address on loopback; port 0 picks one and prints it")
		addrFile = flag.String("addr-file", "", "also write the address to this file once listening")
		otlp     = flag.String("otlp", "", "trace every call and export the spans over OTLP gRPC to this collector on loopback (host:port)")
		f        stormlab.Faults
		tier     stormlab.TierOptions
	)
	tier.RegisterFlags(flag.CommandLine, false)
	flag.Float64Var(&f.FailRate, "fail-rate", 0, "fail each attempt with Unavailable with this probability")
	flag.DurationVar(&f.Outage, "outage", 0, "fail every attempt for this long after the first attempt (the fault clock starts there, at start and after each reset)")
	flag.IntVar(&f.Capacity, "capacity", 0, "attempts accepted per capacity window before the server overloads (0: unlimited)")
	flag.DurationVar(&f.CapacityWindow, "capacity-window", 0, "the capacity window (default: the counting window)")
	flag.DurationVar(&f.RecoverAfter, "recover-after", 0, "how long arrivals must stay within capacity to end an overload (default: one capacity window)")
	flag.Float64Var(&f.LostReplyRate, "lost-reply-rate", 0, "apply a charge, then fail the attempt as if its reply were lost, with this probability")
	flag.Int64Var(&f.Seed, "seed", 1, "seed of the random faults")
	flag.DurationVar(&f.Window, "window", stormlab.DefaultWindow, "width of the counting windows")
	flag.StringVar(&f.Model, "model", stormlab.ModelSticky, `over capacity: "sticky" fails everything until calm, "gentle" queues attempts and fails those that would wait over -queue-limit`)
	flag.DurationVar(&f.QueueLimit, "queue-limit", 0, "the gentle model's longest wait (default: ten capacity windows)")
	flag.DurationVar(&f.TriggerAt, "trigger-at", 0, "start a trigger this long after the first attempt")
	flag.DurationVar(&f.TriggerFor, "trigger-for", 0, "the trigger's length (0: no trigger)")
	flag.IntVar(&f.TriggerCapacity, "trigger-capacity", 0, "attempts accepted per capacity window during the trigger")
	flag.BoolVar(&f.TriggerOutage, "trigger-outage", false, "fail every attempt during the trigger")
	flag.BoolVar(&f.TriggerKill, "trigger-kill", false, "stop listening during the trigger, as a killed process, and listen again on the same address after it")
	flag.Parse()

	if tier.Tier {
		tier.Addr, tier.AddrFile, tier.OTLP = *addr, *addrFile, *otlp
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		err := stormlab.RunTier(ctx, tier, nil, os.Stdout)
		stop()
		if err != nil {
			log.Fatal(err)
		}
		return
	}
	if err := run(*addr, *addrFile, *otlp, f); err != nil {
		log.Fatal(err)
	}
}

func run(addr, addrFile, otlp string, f stormlab.Faults) (err error) {
	if err := stormlab.CheckLoopback(addr); err != nil {
		return fmt.Errorf("-addr: %w", err)
	}
	srv, err := stormlab.NewServer(f)
	if err != nil {
		return err
	}
	var opts []grpc.ServerOption
	if otlp != "" {
		exp, tp, err := stormlab.NewExporter(context.Background(), "demo-server", otlp)
		if err != nil {
			return fmt.Errorf("-otlp: %w", err)
		}
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err = errors.Join(err, exp.Shutdown(ctx))
		}()
		opts = append(opts, stormlab.ServerTracing(tp))
	}
	h, err := srv.Serve(addr, opts...)
	if err != nil {
		return err
	}
	fmt.Printf("demo-server listening on %s\n", h.Addr())
	if addrFile != "" {
		if err := os.WriteFile(addrFile, []byte(h.Addr()), 0o600); err != nil {
			return err
		}
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	<-stop
	h.GracefulStop(2 * time.Second)
	return nil
}
