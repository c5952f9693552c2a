package mesh_test

import (
	"context"
	"testing"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/mesh"
)

// TestAllocServerHalfHealthy: the server half allocates nothing for a
// request whose handler succeeds, unary or stream.
func TestAllocServerHalfHealthy(t *testing.T) {
	unary, stream := mesh.UnaryServerInterceptor(), mesh.StreamServerInterceptor()
	ctx, info, sinfo := context.Background(), &grpc.UnaryServerInfo{FullMethod: "/s/m"}, &grpc.StreamServerInfo{FullMethod: "/s/m"}
	reply := new(int)
	h := func(context.Context, any) (any, error) { return reply, nil }
	sh := func(any, grpc.ServerStream) error { return nil }
	if n := testing.AllocsPerRun(1000, func() {
		if r, err := unary(ctx, nil, info, h); r != reply || err != nil {
			t.Fatalf("unary: %v, %v; want the handler's reply", r, err)
		}
	}); n != 0 {
		t.Errorf("unary: %v allocations per healthy request, want 0", n)
	}
	if n := testing.AllocsPerRun(1000, func() {
		if err := stream(nil, nil, sinfo, sh); err != nil {
			t.Fatalf("stream: %v; want the handler's nil", err)
		}
	}); n != 0 {
		t.Errorf("stream: %v allocations per healthy request, want 0", n)
	}
}

// BenchmarkServerHalf is the cost of the server half on a healthy request:
// the handler called directly, then through the interceptor.
func BenchmarkServerHalf(b *testing.B) {
	ctx, info := context.Background(), &grpc.UnaryServerInfo{FullMethod: "/herdguard.demo.v1.GatewayService/Charge"}
	reply := new(int)
	h := func(context.Context, any) (any, error) { return reply, nil }
	b.Run("handler alone", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = h(ctx, nil)
		}
	})
	b.Run("server half", func(b *testing.B) {
		unary := mesh.UnaryServerInterceptor()
		b.ReportAllocs()
		for b.Loop() {
			_, _ = unary(ctx, nil, info, h)
		}
	})
}
