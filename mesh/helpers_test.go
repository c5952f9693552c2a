package mesh_test

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fast is policy.Default with waits short enough for a test.
func fast(attempts int) policy.Policy {
	p := policy.Default()
	p.MaxAttempts, p.InitialBackoff, p.MaxBackoff = attempts, time.Millisecond, 2*time.Millisecond
	return p
}

// leaf is the bottom of a chain: a real gRPC server whose Charge and
// ListCharges answer as answer says, and that counts its attempts and the
// metadata they carried.
type leaf struct {
	demov1.UnimplementedGatewayServiceServer
	answer func(ctx context.Context, n int64) error
	// stream, if set, answers ListCharges: it may send before failing.
	// Without it ListCharges answers as answer does.
	stream func(ss grpc.ServerStreamingServer[demov1.ListChargesResponse], n int64) error

	attempts atomic.Int64
	mu       sync.Mutex
	md       []metadata.MD
}

func (l *leaf) arrive(ctx context.Context) int64 {
	md, _ := metadata.FromIncomingContext(ctx)
	l.mu.Lock()
	l.md = append(l.md, md)
	l.mu.Unlock()
	return l.attempts.Add(1)
}

func (l *leaf) Charge(ctx context.Context, _ *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	n := l.arrive(ctx)
	if err := l.answer(ctx, n); err != nil {
		return nil, err
	}
	return &demov1.ChargeResponse{ChargeId: "ok"}, nil
}

// ListCharges answers as stream says, or, without it, fails as answer
// says before it sends anything, or sends one message.
func (l *leaf) ListCharges(req *demov1.ListChargesRequest, ss grpc.ServerStreamingServer[demov1.ListChargesResponse]) error {
	n := l.arrive(ss.Context())
	if l.stream != nil {
		return l.stream(ss, n)
	}
	if err := l.answer(ss.Context(), n); err != nil {
		return err
	}
	return ss.Send(&demov1.ListChargesResponse{ChargeId: "ok"})
}

// seen returns the metadata of every attempt the leaf received.
func (l *leaf) seen() []metadata.MD {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]metadata.MD(nil), l.md...)
}

// tier is a middle layer: a real gRPC server whose Charge and ListCharges
// call the next layer through next, with the request's context, and
// answer as wrap says (nil: the downstream error as it is).
type tier struct {
	demov1.UnimplementedGatewayServiceServer
	next  demov1.GatewayServiceClient
	wrap  func(error) error
	calls atomic.Int64
}

func (t *tier) Charge(ctx context.Context, req *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	t.calls.Add(1)
	resp, err := t.next.Charge(ctx, req)
	if err != nil && t.wrap != nil {
		err = t.wrap(err)
	}
	return resp, err
}

func (t *tier) ListCharges(req *demov1.ListChargesRequest, ss grpc.ServerStreamingServer[demov1.ListChargesResponse]) error {
	t.calls.Add(1)
	err := t.forward(ss, req)
	if err != nil && t.wrap != nil {
		err = t.wrap(err)
	}
	return err
}

// forward passes a ListCharges stream on from the next layer.
func (t *tier) forward(ss grpc.ServerStreamingServer[demov1.ListChargesResponse], req *demov1.ListChargesRequest) error {
	cs, err := t.next.ListCharges(ss.Context(), req)
	if err != nil {
		return err
	}
	for {
		m, err := cs.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := ss.Send(m); err != nil {
			return err
		}
	}
}

// serve starts a real gRPC server on 127.0.0.1 with svc and returns its
// address; it stops with the test.
func serve(t testing.TB, svc demov1.GatewayServiceServer, opts ...grpc.ServerOption) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(opts...)
	demov1.RegisterGatewayServiceServer(s, svc)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// dial connects to addr with opts; the connection closes with the test.
func dial(t testing.TB, addr string, opts ...grpc.DialOption) demov1.GatewayServiceClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return demov1.NewGatewayServiceClient(cc)
}

// herdguard returns a herdguard interceptor made of opts, or fails the test.
func herdguard(t testing.TB, opts ...interceptor.Option) *interceptor.Interceptor {
	t.Helper()
	ic, err := interceptor.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return ic
}

// plain is a client that sends each call once (gRPC's retry off), as a
// test's caller.
func plain(t testing.TB, addr string) demov1.GatewayServiceClient {
	return dial(t, addr, grpc.WithDisableRetry())
}
