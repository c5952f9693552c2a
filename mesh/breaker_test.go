package mesh_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// TestUpperBreakerIgnoresGiveUpsBelow: a layer above a tier whose calls
// below give up does not open its breaker on the tier's "don't retry"
// answers, unary or stream: the tier's layer already retried and judged.
// The control, the same tier without the package, shows that the same
// breaker opens on the same failures otherwise (3 in a row trip it).
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
			below := herdguard(t, interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl())
			dopts, sopts := below.DialOptions(), []grpc.ServerOption(nil)
			if tt.withMesh {
				dopts, sopts = mesh.DialOptions(below), mesh.ServerOptions()
			}
			mid := serve(t, &tier{next: dial(t, serve(t, l), dopts...)}, sopts...)
			for _, kind := range []string{"unary", "stream"} {
				above := herdguard(t, interceptor.WithPolicy(fast(3)), interceptor.WithoutOverloadControl(),
					interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Minute}))
				user := dial(t, mid, above.DialOptions()...)
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				open := 0
				for range 6 {
					var err error
					if kind == "unary" {
						_, err = user.Charge(ctx, &demov1.ChargeRequest{})
					} else {
						var cs grpc.ServerStreamingClient[demov1.ListChargesResponse]
						if cs, err = user.ListCharges(ctx, &demov1.ListChargesRequest{}); err == nil {
							_, err = cs.Recv()
						}
					}
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
