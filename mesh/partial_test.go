package mesh_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// TestPartialDeployment: a depth-4 chain, user → A → B → C → leaf, every
// hop herdguard with up to 3 attempts, to a leaf that refuses everything
// and that C judges overloaded, with the package at some tiers only. The
// leaf's attempts per user call are never more than without the package
// anywhere (3^4 = 81): each tier that has it keeps the layers on its
// sides from multiplying, and a tier without it multiplies only the
// layers next to it. A leaf that merely fails (C does not judge it
// overloaded) gets the retries of every layer, as without the package.
func TestPartialDeployment(t *testing.T) {
	tests := []struct {
		name    string
		mesh    [3]bool // A, B, C: both halves, or herdguard alone
		paced   bool    // C paces the leaf, primed to judge it overloaded
		leafPer int64
	}{
		{"nowhere", [3]bool{}, false, 81},
		{"everywhere", [3]bool{true, true, true}, true, 3},
		{"everywhere, a leaf failing on its own", [3]bool{true, true, true}, false, 81},
		// C retries 3 and says don't retry; B stops, but answers A
		// without the trailer, so A and the user retry: 3 × 3 × 1 × 3.
		{"only at the leaf's caller", [3]bool{false, false, true}, true, 27},
		// C, without the package, has no server half to say that it
		// judged the leaf overloaded, and B, A and the user judge nothing
		// (no overload control here): every layer retries, 3⁴.
		{"all but the leaf's caller", [3]bool{true, true, false}, true, 81},
		// A tier without the package in the middle: C retries B's first
		// send 3 times and stops B with "don't retry", but B answers A
		// without the trailer; A, which judges nothing, retries B twice,
		// and the user A twice: 3 × 3 × 1 × 3.
		{"all but the middle", [3]bool{true, false, true}, true, 27},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &leaf{answer: unavailable}
			next := serve(t, l)
			var tiers [3]*tier
			var cAddr string
			for i := 2; i >= 0; i-- {
				opts := []interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl()}
				if i == 2 && tt.paced {
					opts = append(opts, pacingAfterTwo...)
				}
				ic := herdguard(t, opts...)
				var sopts []grpc.ServerOption
				dopts := ic.DialOptions()
				if tt.mesh[i] {
					sopts, dopts = mesh.ServerOptions(), mesh.DialOptions(ic)
				}
				tiers[i] = &tier{next: dial(t, next, dopts...)}
				next = serve(t, tiers[i], sopts...)
				if i == 2 {
					cAddr = next
				}
			}
			if tt.paced {
				primeOverload(plain(t, cAddr))
				l.attempts.Store(0)
			}
			user := dial(t, next, herdguard(t, interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl()).DialOptions()...)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			const calls = 2
			for range calls {
				if _, err := user.Charge(ctx, &demov1.ChargeRequest{}); status.Code(err) != codes.Unavailable {
					t.Fatalf("user call: %v, want Unavailable", err)
				}
			}
			if got := l.attempts.Load(); got != calls*tt.leafPer {
				t.Errorf("the leaf received %d attempts for %d user calls (A %d, B %d, C %d calls), want %d each",
					got, calls, tiers[0].calls.Load(), tiers[1].calls.Load(), tiers[2].calls.Load(), tt.leafPer)
			}
		})
	}
}
