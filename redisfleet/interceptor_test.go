package redisfleet_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/internal/redistest"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/policy"
	"github.com/herdguard/herdguard/redisfleet"
)

// TestInterceptorsShareOneBreaker: two replicas' interceptors, each with
// its own fleet over one real Redis, call one real gRPC server that fails.
// Replica a's failed calls open the fleet's breaker, and replica b's calls
// are refused without reaching the server.
func TestInterceptorsShareOneBreaker(t *testing.T) {
	srv := redistest.Start(t)
	backend := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		return nil, status.Error(codes.Unavailable, "down")
	}})
	clients := make([]testgrpc.TestServiceClient, 2)
	for i := range clients {
		f, err := redisfleet.New(redisfleet.Options{Client: client(t, srv.Addr)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		// 3 attempts a call: the fleet counts calls, not attempts
		p := policy.Policy{MaxAttempts: 3, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}
		ic, err := interceptor.New(interceptor.WithPolicy(p),
			interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Hour, Fleet: f}))
		if err != nil {
			t.Fatal(err)
		}
		clients[i] = backend.Client(t, ic.DialOptions()...)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := f.WaitSynced(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	call := func(c testgrpc.TestServiceClient) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
		return err
	}
	// the breakers join on their first call: b's is the fleet's first failure
	call(clients[1])
	if err := call(clients[0]); status.Code(err) != codes.Unavailable || refusedShared(err) {
		t.Fatalf("replica a's call: %v, want the server's Unavailable", err)
	}
	// two failed calls (six attempts) leave the fleet closed: b's next
	// call still reaches the server, with all its attempts, and is the third
	testutil.Eventually(t, "Redis counts the two failed calls", func() bool {
		n, _ := client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+testserver.Target, "f").Int()
		return n == 2
	})
	sent := backend.Requests()
	if err := call(clients[1]); status.Code(err) != codes.Unavailable || refusedShared(err) {
		t.Fatalf("replica b's second call: %v, want the server's Unavailable", err)
	}
	if got := backend.Requests() - sent; got != 3 {
		t.Fatalf("replica b's call after two failed calls made %d attempts, want 3: the fleet must count calls", got)
	}
	took := testutil.Eventually(t, "replica a is refused by the fleet's breaker", func() bool {
		return refusedShared(call(clients[0]))
	})
	t.Logf("replica b refused %v after the fleet's third failure opened it", took)
	sent = backend.Requests()
	for range 10 {
		for i, c := range clients {
			err := call(c)
			var oe *breaker.OpenError
			if !errors.As(err, &oe) || !oe.Shared || status.Code(err) != codes.Unavailable {
				t.Fatalf("replica %d: %v, want the fleet's refusal", i, err)
			}
		}
	}
	if got := backend.Requests() - sent; got != 0 {
		t.Errorf("the server got %d requests through the open fleet", got)
	}
}
