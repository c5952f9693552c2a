// Command ggm-tier is a tier of the storm lab's mesh (demo-client -mesh)
// whose client is go-grpc-middleware's retry: the demo server's -tier mode
// for the mesh strategy "go-grpc-middleware at every layer", which
// herdguard's module cannot run because it does not depend on
// go-grpc-middleware. It takes the demo server's tier flags:
//
//	ggm-tier -tier -next 127.0.0.1:7001 -mesh-strategy "go-grpc-middleware at every layer" -hop 2 -scale 2 -addr-file f
//
// Its client makes the scenario's attempts (3) on Unavailable, with
// go-grpc-middleware's exponential backoff with 10 % jitter from the
// scenario's first wait (100 ms at full scale), as module bench configures
// it beside the other peers.
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

func main() {
	log.SetFlags(0)
	log.SetPrefix("ggm-tier: ")
	var o stormlab.TierOptions
	o.RegisterFlags(flag.CommandLine, true)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := stormlab.RunTier(ctx, o, stormlab.TierPeers{stormlab.GGMPeer: dial}, os.Stdout)
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

// dial is go-grpc-middleware's retry for the scenario sc (scaled).
func dial(sc stormlab.Scenario) []grpc.DialOption {
	// WithMax counts attempts in its code, whatever its docs say.
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(retry.UnaryClientInterceptor(
		retry.WithMax(uint(sc.Attempts)), retry.WithCodes(codes.Unavailable),
		retry.WithBackoff(retry.BackoffExponentialWithJitter(sc.Base, 0.1))))}
}
