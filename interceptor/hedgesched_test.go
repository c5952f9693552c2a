package interceptor

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// pushbackRig is a hedged call or stream whose first attempt fails, when
// fail is closed, with a pushback, and whose second is held on its way out
// until release is closed (entered is closed when it gets there); every
// other attempt hangs.
type pushbackRig struct {
	fail, entered, release chan struct{}
	arrived                func(t *testing.T, n int) // attempt n reaches the server
	none                   func(t *testing.T)        // no attempt does, for a while
}

// unaryPushbackRig starts the rig's hedged unary call.
func unaryPushbackRig(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig {
	r := &pushbackRig{fail: make(chan struct{}), entered: make(chan struct{}), release: make(chan struct{})}
	srv := startHedgeServer(t)
	srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		<-r.fail
		_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.PushbackKey, pushbackMS))
		return nil, status.Error(codes.Unavailable, "down 1")
	})
	gate := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if md, _ := metadata.FromOutgoingContext(ctx); slices.Contains(md.Get(wire.AttemptKey), "2") {
			close(r.entered)
			select {
			case <-r.release:
			case <-ctx.Done():
				return status.FromContextError(ctx.Err()).Err()
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	ic, err := New(withClock(clk), WithPolicy(hedging(4, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(gate))...)
	ctx, cancel := context.WithCancel(ctxT(t))
	t.Cleanup(cancel)
	go func() { _, _ = c.UnaryCall(ctx, &testgrpc.SimpleRequest{}) }()
	r.arrived, r.none = srv.waitArrival, srv.noArrival
	return r
}

// streamPushbackRig starts the rig's hedged server stream.
func streamPushbackRig(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig {
	r := &pushbackRig{fail: make(chan struct{})}
	sc := newStreamScript()
	sc.on(1, func(ss grpc.ServerStream) error {
		<-r.fail
		ss.SetTrailer(metadata.Pairs(wire.PushbackKey, pushbackMS))
		return status.Error(codes.Unavailable, "down 1")
	})
	srv := startStreamScript(t, sc)
	gate, entered, release := gateAttempt(2)
	r.entered, r.release = entered, release
	ic, err := New(withClock(clk), WithPolicy(hedging(4, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(gate))...)
	ctx, cancel := context.WithCancel(ctxT(t))
	t.Cleanup(cancel)
	if _, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}); err != nil {
		t.Fatal(err)
	}
	r.arrived, r.none = sc.wait, sc.none
	return r
}

// TestHedgePushbackDelaysTheNextHedgeExactly: unary calls and streams share
// one rule for when a pushback delays the next hedge (see hedger): the next
// hedge goes exactly the pushback's delay after it came, the one after a
// hedging delay later (gRFC A6: "Send next hedged request in n ms.
// Subsequent hedged requests will resume at n + hedgingDelay"). Hedge 2 is
// still on its way out when attempt 1 is pushed back; its going out sets
// the timer neither sooner nor later than the pushback says, whether the
// pushback is shorter or longer than the hedging delay. Before the one
// rule, a stream's hedge 2 going live after a 5ms pushback set the timer
// to the 20ms hedging delay, and hedge 3 went 15ms late.
func TestHedgePushbackDelaysTheNextHedgeExactly(t *testing.T) {
	kinds := []struct {
		name  string
		start func(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig
	}{
		{"unary", unaryPushbackRig},
		{"stream", streamPushbackRig},
	}
	pushbacks := []struct {
		name string
		ms   string
		wait time.Duration
	}{
		{"shorter than the delay", "5", 5 * time.Millisecond},
		{"longer than the delay", "1000", time.Second},
	}
	for _, k := range kinds {
		for _, pb := range pushbacks {
			t.Run(k.name+"/"+pb.name, func(t *testing.T) {
				clk := newManualClock()
				r := k.start(t, clk, pb.ms)
				r.arrived(t, 1)
				clk.Advance(hedgeDelay) // hedge 2 goes, and is held on its way out
				<-r.entered
				close(r.fail) // attempt 1 fails, pushed back
				clk.waitArmed(t, pb.wait)
				close(r.release) // hedge 2 goes out
				r.arrived(t, 2)
				// Set for the first attempt, for hedge 2 and for the
				// pushback (unary, which arms as a hedge goes); or for
				// the first, the pushback, and as hedge 2 went live.
				clk.waitArmedN(t, 3)

				clk.Advance(pb.wait - time.Nanosecond)
				r.none(t)
				clk.Advance(time.Nanosecond)
				r.arrived(t, 3) // the pushback's delay after it came
				clk.waitArmedN(t, 4)

				clk.Advance(hedgeDelay - time.Nanosecond)
				r.none(t)
				clk.Advance(time.Nanosecond)
				r.arrived(t, 4) // then the hedging delay
			})
		}
	}
}
