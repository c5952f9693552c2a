package mesh_test

import (
	"context"
	"fmt"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// downLeaf refuses every charge.
type downLeaf struct {
	demov1.UnimplementedGatewayServiceServer
}

func (downLeaf) Charge(context.Context, *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	return nil, status.Error(codes.Unavailable, "leaf: down")
}

// forward is a middle tier: it charges through the next layer, with the
// request's context, and answers what it answers.
type forward struct {
	demov1.UnimplementedGatewayServiceServer
	next demov1.GatewayServiceClient
}

func (f forward) Charge(ctx context.Context, req *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	return f.next.Charge(ctx, req)
}

// A tier installs both halves: the server interceptors on its server, and
// the client half with herdguard on the connection its handlers call
// through. When herdguard gives up below on evidence that retrying from
// above would hurt (here its breaker is open; also when its overload
// controller paced or shed the call, or the call ran out of time), the
// tier's answer tells the layer above not to retry, in gRPC's own words.
// A leaf that merely failed the call gets the retries from above.
func Example() {
	leafLis, _ := net.Listen("tcp", "127.0.0.1:0")
	leaf := grpc.NewServer()
	demov1.RegisterGatewayServiceServer(leaf, downLeaf{})
	go leaf.Serve(leafLis)
	defer leaf.Stop()

	// The tier: herdguard below, with a breaker that opens on one failed
	// call, and both halves of mesh.
	ic, err := interceptor.New(interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: time.Minute}))
	if err != nil {
		fmt.Println(err)
		return
	}
	cc, err := grpc.NewClient(leafLis.Addr().String(), append(mesh.DialOptions(ic), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cc.Close()
	tierLis, _ := net.Listen("tcp", "127.0.0.1:0")
	tier := grpc.NewServer(mesh.ServerOptions()...)
	demov1.RegisterGatewayServiceServer(tier, forward{next: demov1.NewGatewayServiceClient(cc)})
	go tier.Serve(tierLis)
	defer tier.Stop()

	// The layer above: any gRPC client.
	user, err := grpc.NewClient(tierLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer user.Close()
	for _, call := range []string{"first call", "second call"} {
		var trailer metadata.MD
		_, err = demov1.NewGatewayServiceClient(user).Charge(context.Background(), &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
		fmt.Println(call, status.Code(err), "grpc-retry-pushback-ms:", trailer.Get("grpc-retry-pushback-ms"),
			"herdguard-gave-up:", trailer.Get(mesh.GaveUpTrailerKey))
	}
	// Output:
	// first call Unavailable grpc-retry-pushback-ms: [] herdguard-gave-up: []
	// second call Unavailable grpc-retry-pushback-ms: [-1] herdguard-gave-up: [breaker_open]
}

// hangingLeaf answers no charge before its deadline.
type hangingLeaf struct {
	demov1.UnimplementedGatewayServiceServer
}

func (hangingLeaf) Charge(ctx context.Context, _ *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	<-ctx.Done()
	return nil, status.FromContextError(ctx.Err()).Err()
}

// A tier keeps back part of its request's deadline for the answer: its
// call below runs out of time first, and the tier still answers in time,
// saying why, where gRPC's propagation alone times every layer out at
// once.
func ExampleWithDeadlineReserve() {
	leafLis, _ := net.Listen("tcp", "127.0.0.1:0")
	leaf := grpc.NewServer()
	demov1.RegisterGatewayServiceServer(leaf, hangingLeaf{})
	go leaf.Serve(leafLis)
	defer leaf.Stop()

	ic, err := interceptor.New()
	if err != nil {
		fmt.Println(err)
		return
	}
	dopts := mesh.DialOptions(ic, mesh.WithDeadlineReserve(100*time.Millisecond))
	cc, err := grpc.NewClient(leafLis.Addr().String(), append(dopts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cc.Close()
	tierLis, _ := net.Listen("tcp", "127.0.0.1:0")
	tier := grpc.NewServer(mesh.ServerOptions()...)
	demov1.RegisterGatewayServiceServer(tier, forward{next: demov1.NewGatewayServiceClient(cc)})
	go tier.Serve(tierLis)
	defer tier.Stop()

	user, err := grpc.NewClient(tierLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer user.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	var trailer metadata.MD
	_, err = demov1.NewGatewayServiceClient(user).Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
	fmt.Println(status.Code(err), "before the caller's deadline:", ctx.Err() == nil)
	fmt.Println("herdguard-gave-up:", trailer.Get(mesh.GaveUpTrailerKey))
	// Output:
	// DeadlineExceeded before the caller's deadline: true
	// herdguard-gave-up: [deadline]
}
