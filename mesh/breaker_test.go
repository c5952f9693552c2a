package mesh_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// TestUpperBreakerIgnoresGiveUpsBelow: a layer above a tier whose calls
// below give up (its breaker is open) does not open its breaker on the tier's "don't retry"
// answers, unary or stream, retried, hedged (with a non-fatal code, or
// every code fatal) or sent once (the answer comes to the last attempt):
// the tier's layer already retried and judged. The control, the same
// tier without the package, shows that the same breaker opens on the same
// failures otherwise (3 in a row trip it).
func TestUpperBreakerIgnoresGiveUpsBelow(t *testing.T) {
	for _, tt := range []struct {
		name     string
		withMesh bool
		wantOpen bool
	}{{"control: without the package", false, true}, {"with it", true, false}} {
		t.Run(tt.name, func(t *testing.T) {
			l := &leaf{answer: unavailable, stream: func(grpc.ServerStreamingServer[demov1.ListChargesResponse], int64) error {
				return unavailable(context.Background(), 0)
			}}
			below := openingBreaker(t)
			dopts, sopts := below.DialOptions(), []grpc.ServerOption(nil)
			if tt.withMesh {
				dopts, sopts = mesh.DialOptions(below), mesh.ServerOptions()
			}
			mid := serve(t, &tier{next: dial(t, serve(t, l), dopts...)}, sopts...)
			_, _ = plain(t, mid).Charge(context.Background(), &demov1.ChargeRequest{}) // opens the breaker below
			hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Unavailable}}}
			hedgedFatal := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour}}
			for _, c := range []struct {
				kind string
				p    policy.Policy
			}{{"unary", fast(3)}, {"stream", fast(3)}, {"unary", hedged}, {"stream", hedged}, {"unary", hedgedFatal}, {"stream", hedgedFatal}, {"unary", fast(1)}, {"stream", fast(1)}} {
				kind := c.kind
				switch {
				case c.p.Hedging.On() && len(c.p.Hedging.NonFatalCodes) == 0:
					kind += ", hedged, every code fatal"
				case c.p.Hedging.On():
					kind += ", hedged"
				case c.p.MaxAttempts == 1:
					kind += ", one attempt" // the answer comes to the last attempt
				}
				above := herdguard(t, interceptor.WithPolicy(c.p), interceptor.WithoutOverloadControl(),
					interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Minute}))
				user := dial(t, mid, above.DialOptions()...)
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				open := 0
				for range 6 {
					err := callOnce(ctx, user, c.kind)
					if err == nil {
						t.Fatalf("%s: a call through a failing leaf succeeded", kind)
					}
					var oe *breaker.OpenError
					if errors.As(err, &oe) {
						open++
					}
				}
				cancel()
				if got := open > 0; got != tt.wantOpen {
					t.Errorf("%s: %d of 6 calls refused by the breaker above, want the breaker open: %v", kind, open, tt.wantOpen)
				}
			}
		})
	}
}

// TestUpperOverloadIgnoresGiveUpsBelow: a layer above a tier whose calls
// below give up (its breaker is open) does not take the tier's "don't retry" answers for
// overload, unary or stream, retried, hedged or sent once: its controller
// never sheds, where the control, the same tier without the package, soon
// has the same controller shed.
func TestUpperOverloadIgnoresGiveUpsBelow(t *testing.T) {
	shedWithin := func(t *testing.T, kind string, p policy.Policy, withMesh bool, calls int) (shed, made int) {
		l := &leaf{answer: unavailable, stream: func(grpc.ServerStreamingServer[demov1.ListChargesResponse], int64) error {
			return unavailable(context.Background(), 0)
		}}
		below := openingBreaker(t)
		dopts, sopts := below.DialOptions(), []grpc.ServerOption(nil)
		if withMesh {
			dopts, sopts = mesh.DialOptions(below), mesh.ServerOptions()
		}
		mid := serve(t, &tier{next: dial(t, serve(t, l), dopts...)}, sopts...)
		_, _ = plain(t, mid).Charge(context.Background(), &demov1.ChargeRequest{}) // opens the breaker below
		// A serial caller probes at the controller's floor: a short
		// DownAfter lets it judge the tier down within the test.
		above := herdguard(t, interceptor.WithPolicy(p), interceptor.WithoutBreaker(),
			interceptor.WithOverloadControl(overload.Settings{Interval: 10 * time.Millisecond, MinFailures: 2, DownAfter: 100 * time.Millisecond}))
		user := dial(t, mid, above.DialOptions()...)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		for made < calls && ctx.Err() == nil {
			err := callOnce(ctx, user, kind)
			made++
			var re *interceptor.RetryError
			if errors.As(err, &re) && re.Outcome == interceptor.OutcomeShed {
				shed++
				if !withMesh {
					return shed, made
				}
			}
			time.Sleep(time.Millisecond) // a call per millisecond, so that intervals pass
		}
		return shed, made
	}
	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Unavailable}}}
	hedgedFatal := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour}}
	for _, c := range []struct {
		name, kind string
		p          policy.Policy
	}{{"unary", "unary", fast(3)}, {"stream", "stream", fast(3)}, {"unary, hedged", "unary", hedged}, {"stream, hedged", "stream", hedged},
		{"unary, hedged, every code fatal", "unary", hedgedFatal}, {"stream, hedged, every code fatal", "stream", hedgedFatal},
		{"unary, one attempt", "unary", fast(1)}, {"stream, one attempt", "stream", fast(1)}} {
		kind := c.kind
		t.Run(c.name, func(t *testing.T) {
			shed, made := shedWithin(t, kind, c.p, false, 1<<20)
			if shed == 0 {
				t.Fatalf("control: no call shed in %d calls within 20 s through a tier that fails every one", made)
			}
			n := max(2*made, 300)
			if shed, made := shedWithin(t, kind, c.p, true, n); shed != 0 || made != n {
				t.Errorf("with the package: %d of %d calls shed by the controller above (of %d asked), want none", shed, made, n)
			}
		})
	}
}

// openingBreaker is the tier below's herdguard: 3 attempts, and a breaker
// that opens on the first failed call and stays open: every later call
// below gives up at once (breaker_open), which the server half answers
// with "don't retry". (A call out of attempts at a server nobody judged
// overloaded is not a give-up the server half passes on.)
func openingBreaker(t *testing.T) *interceptor.Interceptor {
	return herdguard(t, interceptor.WithPolicy(fast(3)), interceptor.WithoutOverloadControl(),
		interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: time.Hour}))
}

// callOnce makes one call of kind "unary" (Charge) or "stream"
// (ListCharges, up to its first message) and returns how it ended.
func callOnce(ctx context.Context, user demov1.GatewayServiceClient, kind string) error {
	if kind == "unary" {
		_, err := user.Charge(ctx, &demov1.ChargeRequest{})
		return err
	}
	cs, err := user.ListCharges(ctx, &demov1.ListChargesRequest{})
	if err != nil {
		return err
	}
	_, err = cs.Recv()
	return err
}
