package mesh_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// chain is user → gateway → service → leaf, each tier a real server whose
// calls below retry up to 3 attempts through herdguard, with (withMesh) or
// without both halves of the package. With paced, the service's calls to
// the leaf go through pacingAfterTwo: prime makes it judge a leaf that
// refuses everything overloaded.
type chain struct {
	user             demov1.GatewayServiceClient
	gateway, service *tier
	serviceAddr      string
	leaf             *leaf
}

func newChain(t *testing.T, withMesh, paced bool, answer func(context.Context, int64) error, mopts ...mesh.Option) *chain {
	t.Helper()
	c := &chain{leaf: &leaf{answer: answer}}
	hop := func(addr string, paced bool) demov1.GatewayServiceClient {
		opts := []interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl()}
		if paced {
			opts = append(opts, pacingAfterTwo...)
		}
		ic := herdguard(t, opts...)
		if withMesh {
			return dial(t, addr, mesh.DialOptions(ic, mopts...)...)
		}
		return dial(t, addr, ic.DialOptions()...)
	}
	var sopts []grpc.ServerOption
	if withMesh {
		sopts = mesh.ServerOptions()
	}
	c.service = &tier{next: hop(serve(t, c.leaf), paced)}
	c.serviceAddr = serve(t, c.service, sopts...)
	c.gateway = &tier{next: hop(c.serviceAddr, false)}
	c.user = hop(serve(t, c.gateway, sopts...), false)
	return c
}

// prime makes primeCalls calls through the service alone, so that a paced
// service judges a leaf that refuses them overloaded, and then forgets
// the leaf's and the tiers' counts.
func (c *chain) prime(t *testing.T) {
	svc := plain(t, c.serviceAddr)
	for range primeCalls {
		_, _ = svc.Charge(context.Background(), &demov1.ChargeRequest{})
	}
	c.leaf.attempts.Store(0)
	c.service.calls.Store(0)
}

// TestOneLayerRetries: with the package at every tier of a depth-3 chain
// to a leaf that refuses everything and that the service judges
// overloaded, the leaf receives the 3 attempts of the layer right above it
// per user call, against 27 without; many user calls at once, so that the
// race detector sees the propagation. A leaf that fails on its own (not
// judged overloaded) gets the retries of every layer, as without the
// package.
func TestOneLayerRetries(t *testing.T) {
	for _, tt := range []struct {
		name            string
		withMesh, paced bool
		leafPer         int64
	}{{"without the package", false, false, 27}, {"with it", true, true, 3}, {"with it, a leaf failing on its own", true, false, 27}} {
		t.Run(tt.name, func(t *testing.T) {
			c := newChain(t, tt.withMesh, tt.paced, unavailable)
			if tt.paced {
				c.prime(t)
			}
			const calls = 16
			var wg sync.WaitGroup
			errs := make(chan error, calls)
			for range calls {
				wg.Go(func() {
					_, err := c.user.Charge(context.Background(), &demov1.ChargeRequest{})
					errs <- err
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if status.Code(err) != codes.Unavailable {
					t.Errorf("user call: %v, want Unavailable", err)
				}
			}
			if got := c.leaf.attempts.Load(); got != calls*tt.leafPer {
				t.Errorf("the leaf received %d attempts for %d user calls, want %d each", got, calls, tt.leafPer)
			}
		})
	}
}

// TestRetryAboveLimitsEveryLayerBelow: a user call that is itself a retry
// (gRPC's grpc-previous-rpc-attempts) makes one attempt at every layer
// below, each passing herdguard-retries-below: 0 on, and each answering
// "don't retry" above it; a first send carries
// nothing new, and a request whose calls below succeed is answered as
// without the package. Unary calls and server streams, which the tiers
// pass on through the stream halves.
func TestRetryAboveLimitsEveryLayerBelow(t *testing.T) {
	for _, kind := range []string{"unary", "stream"} {
		t.Run(kind, func(t *testing.T) {
			var down atomic.Bool
			c := newChain(t, true, true, func(context.Context, int64) error {
				if down.Load() {
					return status.Error(codes.Unavailable, "leaf: down")
				}
				return nil
			})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			call := func(ctx context.Context) (metadata.MD, error) {
				if kind == "stream" {
					return drain(ctx, c.user, interceptor.NoRetry())
				}
				var trailer metadata.MD
				_, err := c.user.Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer), interceptor.NoRetry())
				return trailer, err
			}

			// A healthy first send: no new metadata below, no trailer above.
			trailer, err := call(ctx)
			if err != nil {
				t.Fatal(err)
			}
			checkTrailer(t, trailer, "")
			for _, md := range c.leaf.seen() {
				if v := md.Get(mesh.RetriesBelowKey); len(v) > 0 {
					t.Errorf("a first send reached the leaf with %s %v, want none", mesh.RetriesBelowKey, v)
				}
			}

			// A retry from above, to a leaf that refuses it: one attempt at
			// each layer, and the leaf sees the limit passed on.
			down.Store(true)
			c.prime(t) // the service judges the leaf overloaded
			before := c.leaf.attempts.Load()
			gw, svc := c.gateway.calls.Load(), c.service.calls.Load()
			trailer, err = call(metadata.AppendToOutgoingContext(ctx, "grpc-previous-rpc-attempts", "1"))
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("retried call: %v, want Unavailable", err)
			}
			// The service's one attempt failed: it answers the gateway
			// retried_above, and the gateway, whose call below that
			// "don't retry" stopped, answers the user pushback_stop.
			checkTrailer(t, trailer, string(interceptor.OutcomePushbackStop))
			// The user's hop sent one attempt (NoRetry): what the tiers below
			// did is what the retry above caused.
			if g, s, l := c.gateway.calls.Load()-gw, c.service.calls.Load()-svc, c.leaf.attempts.Load()-before; g != 1 || s != 1 || l != 1 {
				t.Errorf("gateway %d, service %d, leaf %d attempts for a retried call, want 1 each", g, s, l)
			}
			seen := c.leaf.seen()
			if v := seen[len(seen)-1].Get(mesh.RetriesBelowKey); len(v) != 1 || v[0] != "0" {
				t.Errorf("the leaf saw %s %v, want [0] passed on from the gateway", mesh.RetriesBelowKey, v)
			}
		})
	}
}

// TestReserveAnswersInTime: a leaf that hangs until its deadline, below a
// depth-3 chain whose tiers keep back 100 ms each. The service's call to
// the leaf runs out of time first, at least two reserves before the
// user's deadline, and the user's call ends before its deadline, saying
// "don't retry" because a layer below gave up. Without the package the
// leaf has the user's deadline, and the user's own deadline ends the call
// with no trailer.
func TestReserveAnswersInTime(t *testing.T) {
	const timeout, reserve = 2 * time.Second, 100 * time.Millisecond
	for _, tt := range []struct {
		name     string
		withMesh bool
		gaveUp   string
	}{{"without the package", false, ""}, {"with it", true, string(interceptor.OutcomePushbackStop)}} {
		t.Run(tt.name, func(t *testing.T) {
			dls := make(chan time.Time, 1)
			c := newChain(t, tt.withMesh, false, func(ctx context.Context, _ int64) error {
				dl, _ := ctx.Deadline()
				dls <- dl
				<-ctx.Done()
				return status.FromContextError(ctx.Err()).Err()
			}, mesh.WithDeadlineReserve(reserve))
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			userDL, _ := ctx.Deadline()
			var trailer metadata.MD
			_, err := c.user.Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
			ended := time.Now()
			if status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("call to a hanging leaf: %v, want DeadlineExceeded", err)
			}
			checkTrailer(t, trailer, tt.gaveUp)
			leafDL := <-dls
			// Two reserves less the transit, or gRPC's propagation alone
			// (the transit only: less than half a reserve either way).
			early := userDL.Sub(leafDL)
			if tt.withMesh && early < 3*reserve/2 || !tt.withMesh && (early > reserve/2 || early < -reserve/2) {
				t.Errorf("the leaf's deadline is %v before the user's, want about %v", early, map[bool]time.Duration{true: 2 * reserve}[tt.withMesh])
			}
			if tt.withMesh && !ended.Before(userDL) {
				t.Errorf("the call ended %v after the user's deadline, want before it", ended.Sub(userDL))
			}
			if l := c.leaf.attempts.Load(); l != 1 {
				t.Errorf("the leaf received %d attempts, want 1: an attempt that ran out of time is not retried", l)
			}
		})
	}
}

// TestNoHarmLeafFailingOnItsOwn: a leaf that fails half its attempts on
// its own (Unavailable, whatever the load) below a depth-3 chain whose
// hops run herdguard's defaults (3 attempts each, quick waits). With both
// halves of the package at every tier, the user gets at least the calls ok
// of herdguard at every layer without it, less 1 point: nothing judged
// the leaf overloaded, so no tier says "don't retry" or limits the calls
// below a retry above to one attempt: every layer retries, as without the
// package. The leaf's failures are fixed by attempt number.
func TestNoHarmLeafFailingOnItsOwn(t *testing.T) {
	failing := func(_ context.Context, n int64) error {
		if rand.New(rand.NewPCG(uint64(n), 7)).Float64() < 0.5 {
			return status.Error(codes.Unavailable, "leaf: failed on its own")
		}
		return nil
	}
	const calls = 400
	ok := map[bool]int{}
	for _, withMesh := range []bool{false, true} {
		l := &leaf{answer: failing}
		hop := func(addr string) demov1.GatewayServiceClient {
			ic := herdguard(t, interceptor.WithPolicy(fast(3)))
			if withMesh {
				return dial(t, addr, mesh.DialOptions(ic)...)
			}
			return dial(t, addr, ic.DialOptions()...)
		}
		var sopts []grpc.ServerOption
		if withMesh {
			sopts = mesh.ServerOptions()
		}
		service := &tier{next: hop(serve(t, l))}
		gateway := &tier{next: hop(serve(t, service, sopts...))}
		user := hop(serve(t, gateway, sopts...))
		for range calls {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if _, err := user.Charge(ctx, &demov1.ChargeRequest{}); err == nil {
				ok[withMesh]++
			}
			cancel()
		}
		t.Logf("with the package %v: %d of %d calls ok, %.2f leaf attempts per call", withMesh, ok[withMesh], calls, float64(l.attempts.Load())/calls)
	}
	if ok[true] < ok[false]-calls/100 {
		t.Errorf("with the package %d of %d calls ok, without it %d: want at most 1 point fewer", ok[true], calls, ok[false])
	}
}
