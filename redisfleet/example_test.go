package redisfleet_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	"github.com/herdguard/herdguard/redisfleet"
)

// Every replica of a service builds its client this way: the replicas that
// call the same target share one breaker through Redis. Here two replicas
// (two interceptors in one process, each with its own Redis client and
// Fleet, as two processes would have) call a server that is down. Replica
// a's three failed calls open the fleet's breaker, and replica b, which
// has made no call, then refuses at once without reaching the server.
// Redis and the server run on 127.0.0.1 for the example.
func Example() {
	redisAddr := redisForExamples() // in a service: your Redis
	target, down, stop := serveDown()
	defer stop()

	replica := func() (*interceptor.Interceptor, testgrpc.TestServiceClient, func()) {
		rdb := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true,
			DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond,
			WriteTimeout: 100 * time.Millisecond, MaxRetries: -1})
		fleet, err := redisfleet.New(redisfleet.Options{Client: rdb})
		if err != nil {
			log.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := fleet.WaitSynced(ctx); err != nil { // optional: follows the fleet from now on
			log.Fatal(err)
		}
		ic, err := interceptor.New(
			interceptor.WithPolicy(policy.Policy{InitialBackoff: 10 * time.Millisecond}),
			interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 3, Fleet: fleet}))
		if err != nil {
			log.Fatal(err)
		}
		cc, err := grpc.NewClient(target,
			append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
		if err != nil {
			log.Fatal(err)
		}
		return ic, testgrpc.NewTestServiceClient(cc), func() { cc.Close(); fleet.Close(); rdb.Close() }
	}
	_, a, closeA := replica()
	defer closeA()
	icB, b, closeB := replica()
	defer closeB()

	ctx := context.Background()
	for range 3 { // 3 attempts each: the fleet counts calls
		_, err := a.EmptyCall(ctx, &testgrpc.Empty{})
		fmt.Println("replica a:", status.Code(err))
	}
	// Replica b hears that the fleet's breaker opened within milliseconds.
	shared := icB.Breakers().Get(target, "")
	for wait := time.Now().Add(5 * time.Second); time.Now().Before(wait); time.Sleep(time.Millisecond) {
		if s, _ := shared.FleetState(); s == breaker.Open {
			break
		}
	}
	_, err := b.EmptyCall(ctx, &testgrpc.Empty{})
	var open *breaker.OpenError
	fmt.Println("replica b refused by the fleet's breaker:", errors.As(err, &open) && open.Shared)
	fmt.Println("attempts the server saw:", down.calls.Load())
	// Output:
	// replica a: Unavailable
	// replica a: Unavailable
	// replica a: Unavailable
	// replica b refused by the fleet's breaker: true
	// attempts the server saw: 9
}

// downServer answers every call Unavailable.
type downServer struct {
	testgrpc.UnimplementedTestServiceServer
	calls atomic.Int32
}

func (d *downServer) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	d.calls.Add(1)
	return nil, status.Error(codes.Unavailable, "down")
}

// serveDown starts a downServer on 127.0.0.1 and returns its target, the
// server, and how to stop it.
func serveDown() (target string, d *downServer, stop func()) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer()
	d = &downServer{}
	testgrpc.RegisterTestServiceServer(srv, d)
	go srv.Serve(lis)
	return "passthrough:///" + lis.Addr().String(), d, srv.Stop
}
