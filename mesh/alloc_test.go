package mesh_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

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

// BenchmarkClientHalf is the cost of the client half on a healthy call
// below: the invoker called directly, then through the client half, for a
// call made outside a request, inside one without a deadline, and inside
// one with a deadline (the reserve's context and its timer).
func BenchmarkClientHalf(b *testing.B) {
	invoker := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }
	const method = "/herdguard.demo.v1.GatewayService/Charge"
	in := metadata.NewIncomingContext(context.Background(), metadata.Pairs("user-agent", "grpc-go", "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
	served := grpc.NewContextWithServerTransportStream(in, serverStream{})
	withDeadline, cancel := context.WithTimeout(served, time.Hour)
	defer cancel()
	b.Run("invoker alone", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = invoker(served, method, nil, nil, nil)
		}
	})
	half := mesh.UnaryClientInterceptor()
	for _, c := range []struct {
		name string
		ctx  context.Context
	}{{"client half, outside a request", context.Background()}, {"client half, a request without a deadline", served}, {"client half, a request with a deadline", withDeadline}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = half(c.ctx, method, nil, nil, nil, invoker)
			}
		})
	}
}

// serverStream stands for the transport stream gRPC puts in a handler's
// context, which the client half looks for to tell a request being served.
type serverStream struct{}

func (serverStream) Method() string               { return "/herdguard.demo.v1.GatewayService/Charge" }
func (serverStream) SetHeader(metadata.MD) error  { return nil }
func (serverStream) SendHeader(metadata.MD) error { return nil }
func (serverStream) SetTrailer(metadata.MD) error { return nil }
