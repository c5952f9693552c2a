package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/herdguard/herdguard/internal/names"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
	"github.com/herdguard/herdguard/redisfleet"
)

// replicaFlags configure one replica process.
type replicaFlags struct {
	addr, redis     string // the backend; Redis ("" keeps the breaker to the replica)
	rate            float64
	start, end      int64 // unix ns: when to make the first call, and stop
	deadline        time.Duration
	openTimeout     time.Duration
	attempts        int
	base            time.Duration
	poll            time.Duration
	recoveredAt     int64 // unix ns: when the backend recovers
	consecutiveFail uint
}

// report is what a replica prints when done, as JSON.
type report struct {
	// Transitions of the breaker's view, as polled: "own" and "shared"
	// states with their times (unix ns).
	Transitions []transition `json:"transitions"`
	Probes      []int64      `json:"probes"` // when each probe call started
	Calls       []call       `json:"calls"`
}

type transition struct {
	At     int64  `json:"at"`
	Whose  string `json:"whose"` // "own" or "shared"
	State  string `json:"state"` // "closed", "open", "half-open", or "lost" (shared only)
	Shared bool   `json:"shared"`
}

type call struct {
	At      int64  `json:"at"`      // unix ns the call started
	Took    int64  `json:"took"`    // ns
	Outcome string `json:"outcome"` // "ok", "failed", "refused", "refused_shared"
}

func replicaMain(args []string, out io.Writer) error {
	var f replicaFlags
	fs := flag.NewFlagSet("replica", flag.ContinueOnError)
	fs.StringVar(&f.addr, "addr", "", "")
	fs.StringVar(&f.redis, "redis", "", "")
	fs.Float64Var(&f.rate, "rate", 20, "")
	fs.Int64Var(&f.start, "start", 0, "")
	fs.Int64Var(&f.end, "end", 0, "")
	fs.Int64Var(&f.recoveredAt, "recovered", 0, "")
	fs.DurationVar(&f.deadline, "deadline", 2*time.Second, "")
	fs.DurationVar(&f.openTimeout, "open-timeout", time.Second, "")
	fs.IntVar(&f.attempts, "attempts", 3, "")
	fs.DurationVar(&f.base, "base", 100*time.Millisecond, "")
	fs.DurationVar(&f.poll, "poll", time.Millisecond, "")
	fs.UintVar(&f.consecutiveFail, "consecutive-failures", 5, "")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx := context.Background()

	// The lab compares breakers: open periods of a fixed length, as the
	// fleet's shared breaker in Redis keeps them.
	s := breaker.Settings{ConsecutiveFailures: uint32(f.consecutiveFail), OpenTimeout: f.openTimeout, MaxOpenTimeout: f.openTimeout}
	if f.redis != "" {
		rc := redis.NewClient(&redis.Options{Addr: f.redis, ContextTimeoutEnabled: true,
			DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond, WriteTimeout: 100 * time.Millisecond,
			MaxRetries: -1})
		defer rc.Close()
		fleet, err := redisfleet.New(redisfleet.Options{Client: rc})
		if err != nil {
			return err
		}
		defer fleet.Close()
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = fleet.WaitSynced(wctx)
		cancel()
		if err != nil {
			return fmt.Errorf("redis %s: %w", f.redis, err)
		}
		s.Fleet = fleet
	}
	probes := &probeRecorder{}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(probes))
	defer tp.Shutdown(ctx)
	p := policy.Default()
	p.MaxAttempts, p.InitialBackoff = f.attempts, f.base
	// The breakers alone: the overload controller, on by default, would
	// pace each replica's attempts to the dead backend by itself.
	ic, err := interceptor.New(interceptor.WithPolicy(p), interceptor.WithBreaker(s), interceptor.WithoutOverloadControl(),
		interceptor.WithTracerProvider(tp))
	if err != nil {
		return err
	}
	cc, err := grpc.NewClient(f.addr, append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return err
	}
	defer cc.Close()
	client := demov1.NewGatewayServiceClient(cc)
	b := ic.Breakers().Get(cc.Target(), demov1.GatewayService_Charge_FullMethodName)

	var rep report
	stopPoll := make(chan struct{})
	polled := make(chan struct{})
	go func() { defer close(polled); rep.Transitions = poll(b, f.poll, stopPoll) }()

	time.Sleep(time.Until(time.Unix(0, f.start)))
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	interval := time.Duration(float64(time.Second) / f.rate)
	for at := time.Unix(0, f.start); at.Before(time.Unix(0, f.end)); at = at.Add(interval) {
		time.Sleep(time.Until(at))
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, f.deadline)
			defer cancel()
			began := time.Now()
			_, err := client.Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
			c := call{At: began.UnixNano(), Took: int64(time.Since(began)), Outcome: outcome(err)}
			mu.Lock()
			rep.Calls = append(rep.Calls, c)
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(stopPoll)
	<-polled
	rep.Probes = probes.times()
	return json.NewEncoder(out).Encode(rep)
}

func outcome(err error) string {
	var oe *breaker.OpenError
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &oe) && oe.Shared:
		return "refused_shared"
	case errors.As(err, &oe):
		return "refused"
	}
	return "failed"
}

// poll records every change of the breaker's own state and of the fleet's
// state as this replica sees it, every period, until stop closes.
func poll(b *breaker.Breaker, period time.Duration, stop <-chan struct{}) []transition {
	var out []transition
	own, shared := "", ""
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		now := time.Now().UnixNano()
		if s := b.State().String(); s != own {
			own = s
			out = append(out, transition{At: now, Whose: "own", State: s})
		}
		fs := "lost"
		if s, ok := b.FleetState(); ok {
			fs = s.String()
		}
		if fs != shared {
			shared = fs
			out = append(out, transition{At: now, Whose: "shared", State: fs, Shared: fs != "lost"})
		}
		select {
		case <-stop:
			return out
		case <-t.C:
		}
	}
}

// probeRecorder notes when each probe call (a call span marked
// herdguard.breaker.probe) started.
type probeRecorder struct {
	mu sync.Mutex
	at []int64
}

func (p *probeRecorder) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (p *probeRecorder) OnEnd(s sdktrace.ReadOnlySpan) {
	for _, kv := range s.Attributes() {
		if kv.Key == names.AttrBreakerProbe && kv.Value.Type() == attribute.BOOL && kv.Value.AsBool() {
			p.mu.Lock()
			p.at = append(p.at, s.StartTime().UnixNano())
			p.mu.Unlock()
		}
	}
}
func (p *probeRecorder) Shutdown(context.Context) error   { return nil }
func (p *probeRecorder) ForceFlush(context.Context) error { return nil }

func (p *probeRecorder) times() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int64(nil), p.at...)
}
