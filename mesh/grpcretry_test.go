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

// retryConfig is a service config that has gRPC's built-in retry make up
// to 3 attempts of every GatewayService call that fails Unavailable.
const retryConfig = `{"methodConfig": [{
  "name": [{"service": "herdguard.demo.v1.GatewayService"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.001s", "maxBackoff": "0.002s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`

// TestGRPCRetryAboveStops: gRPC's own retry, at the layer above a tier
// whose call below gave up at a leaf it judged overloaded, stops when the server half answers "don't
// retry". The control, the same tier without the package, shows that the
// same client retries the same failure otherwise.
func TestGRPCRetryAboveStops(t *testing.T) {
	for _, tt := range []struct {
		name       string
		withMesh   bool
		tierCalls  int64
		leafPerTry int64
	}{{"control: without the package", false, 3, 3}, {"with the server half", true, 1, 3}} {
		t.Run(tt.name, func(t *testing.T) {
			l := &leaf{answer: unavailable}
			ic := herdguard(t, append([]interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker()}, pacingAfterTwo...)...)
			dopts, sopts := ic.DialOptions(), []grpc.ServerOption(nil)
			if tt.withMesh {
				dopts, sopts = mesh.DialOptions(ic), mesh.ServerOptions()
			}
			mid := &tier{next: dial(t, serve(t, l), dopts...)}
			midAddr := serve(t, mid, sopts...)
			primeOverload(plain(t, midAddr)) // the tier judges the leaf overloaded
			l.attempts.Store(0)
			mid.calls.Store(0)
			user := dial(t, midAddr, grpc.WithDefaultServiceConfig(retryConfig))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := user.Charge(ctx, &demov1.ChargeRequest{})
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("call: %v, want Unavailable", err)
			}
			if got := mid.calls.Load(); got != tt.tierCalls {
				t.Errorf("gRPC's retry sent the tier %d attempts, want %d", got, tt.tierCalls)
			}
			if got := l.attempts.Load(); got != tt.tierCalls*tt.leafPerTry {
				t.Errorf("the leaf received %d attempts, want %d", got, tt.tierCalls*tt.leafPerTry)
			}
		})
	}
}
