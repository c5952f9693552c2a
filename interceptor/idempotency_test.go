package interceptor

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// gateway fails every attempt with Unavailable and records the
// idempotency keys it saw, per method.
type gateway struct {
	demov1.UnimplementedGatewayServiceServer
	mu   sync.Mutex
	keys map[string][]string
}

func (g *gateway) seen(ctx context.Context, method string) error {
	md, _ := metadata.FromIncomingContext(ctx)
	g.mu.Lock()
	defer g.mu.Unlock()
	g.keys[method] = append(g.keys[method], append(md.Get("idempotency-key"), "")[0])
	return status.Error(codes.Unavailable, "flaky")
}

func (g *gateway) Charge(ctx context.Context, _ *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	return nil, g.seen(ctx, "Charge")
}

func (g *gateway) GetStats(ctx context.Context, _ *demov1.GetStatsRequest) (*demov1.GetStatsResponse, error) {
	return nil, g.seen(ctx, "GetStats")
}

func (g *gateway) ResetStats(ctx context.Context, _ *demov1.ResetStatsRequest) (*demov1.ResetStatsResponse, error) {
	return nil, g.seen(ctx, "ResetStats")
}

func (g *gateway) ListCharges(_ *demov1.ListChargesRequest, ss grpc.ServerStreamingServer[demov1.ListChargesResponse]) error {
	return g.seen(ss.Context(), "ListCharges")
}

func (g *gateway) UploadReceipts(ss grpc.ClientStreamingServer[demov1.UploadReceiptsRequest, demov1.UploadReceiptsResponse]) error {
	return g.seen(ss.Context(), "UploadReceipts")
}

func (g *gateway) count(method string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.keys[method])
}

func startGateway(t *testing.T, opts ...Option) (*gateway, demov1.GatewayServiceClient) {
	t.Helper()
	g := &gateway{keys: map[string][]string{}}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	demov1.RegisterGatewayServiceServer(srv, g)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	// The gateway refuses everything: overload control, which would step
	// in after a run of refusals, is off so that the attempts counted are
	// the idempotency gate's.
	ic, err := New(append([]Option{withClock(newFakeClock()), WithoutBreaker(), WithoutOverloadControl()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient("passthrough:///bufnet", append(ic.DialOptions(),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return g, demov1.NewGatewayServiceClient(cc)
}

func TestIdempotentOnlyGatesByDescriptor(t *testing.T) {
	g, c := startGateway(t, WithIdempotentOnly())
	ctx := ctxT(t)

	_, err := c.Charge(ctx, &demov1.ChargeRequest{AmountCents: 1})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Charge: %v", err)
	}
	if n := g.count("Charge"); n != 1 {
		t.Errorf("Charge (not idempotent) reached the server %d times, want 1", n)
	}
	c.GetStats(ctx, &demov1.GetStatsRequest{})     // NO_SIDE_EFFECTS
	c.ResetStats(ctx, &demov1.ResetStatsRequest{}) // IDEMPOTENT
	if n, m := g.count("GetStats"), g.count("ResetStats"); n != 3 || m != 3 {
		t.Errorf("GetStats sent %d, ResetStats %d attempts; want 3 each (idempotent methods retry)", n, m)
	}
	// streams: ListCharges is NO_SIDE_EFFECTS, UploadReceipts is not marked
	if s, err := c.ListCharges(ctx, &demov1.ListChargesRequest{}); err == nil {
		s.Recv()
	}
	if s, err := c.UploadReceipts(ctx); err == nil {
		s.CloseAndRecv()
	}
	if n, m := g.count("ListCharges"), g.count("UploadReceipts"); n != 3 || m != 1 {
		t.Errorf("ListCharges sent %d, UploadReceipts %d attempts; want 3 and 1", n, m)
	}
}

func TestIdempotentOnlyRetriesWhatNeverLeft(t *testing.T) {
	// a target nothing listens on: no attempt can reach a server, so even a
	// charge may be retried
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithIdempotentOnly())
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient("passthrough:///nowhere", append(ic.DialOptions(),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return nil, net.ErrClosed }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	_, err = demov1.NewGatewayServiceClient(cc).Charge(ctxT(t), &demov1.ChargeRequest{AmountCents: 1})
	var re *RetryError
	if status.Code(err) != codes.Unavailable || !errors.As(err, &re) || re.Attempts != 3 || re.Outcome != OutcomeExhausted {
		t.Errorf("Charge to nowhere: %v, want Unavailable after 3 attempts", err)
	}
}

// TestIdempotentOnlyForgetsThePeerOfTheCallBefore: whether an attempt
// reached a server is read from the peer gRPC reports for it, caught into a
// pooled buffer. A call that reached a server must leave nothing there for
// the next: each round, a charge reaches a server and fails (1 attempt),
// then a charge through the same interceptor to a target nothing listens on
// must still be retried (3 attempts).
func TestIdempotentOnlyForgetsThePeerOfTheCallBefore(t *testing.T) {
	g := &gateway{keys: map[string][]string{}}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	demov1.RegisterGatewayServiceServer(srv, g)
	go srv.Serve(lis)
	defer srv.Stop()
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithoutOverloadControl(), WithIdempotentOnly())
	if err != nil {
		t.Fatal(err)
	}
	dial := func(dialer func(context.Context, string) (net.Conn, error)) demov1.GatewayServiceClient {
		cc, err := grpc.NewClient("passthrough:///bufnet", append(ic.DialOptions(),
			grpc.WithContextDialer(dialer), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return demov1.NewGatewayServiceClient(cc)
	}
	reached := dial(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) })
	nowhere := dial(func(context.Context, string) (net.Conn, error) { return nil, net.ErrClosed })
	for i := range 20 {
		n := g.count("Charge")
		if _, err := reached.Charge(ctxT(t), &demov1.ChargeRequest{AmountCents: 1}); status.Code(err) != codes.Unavailable {
			t.Fatalf("round %d: charge to the server: %v", i, err)
		}
		if got := g.count("Charge") - n; got != 1 {
			t.Fatalf("round %d: a charge reached the server %d times, want 1", i, got)
		}
		_, err := nowhere.Charge(ctxT(t), &demov1.ChargeRequest{AmountCents: 1})
		var re *RetryError
		if !errors.As(err, &re) || re.Attempts != 3 {
			t.Fatalf("round %d: a charge to nowhere after one that reached a server: %v, want 3 attempts", i, err)
		}
	}
}

func TestIdempotencyKeyIsOnePerCall(t *testing.T) {
	g, c := startGateway(t, WithIdempotencyKey("idempotency-key"))
	ctx := ctxT(t)
	c.Charge(ctx, &demov1.ChargeRequest{AmountCents: 1})
	c.Charge(ctx, &demov1.ChargeRequest{AmountCents: 1})
	if s, err := c.UploadReceipts(ctx); err == nil {
		s.Send(&demov1.UploadReceiptsRequest{Receipt: []byte("r")})
		s.CloseAndRecv()
	}
	g.mu.Lock()
	charges, uploads := g.keys["Charge"], g.keys["UploadReceipts"]
	g.mu.Unlock()
	if len(charges) != 6 {
		t.Fatalf("%d charge attempts, want 6", len(charges))
	}
	first, second := charges[0], charges[3]
	if len(first) != 32 || first == second {
		t.Errorf("keys %q and %q: want 32 hex digits, different per call", first, second)
	}
	for i, k := range charges {
		if want := []string{first, second}[i/3]; k != want {
			t.Errorf("attempt %d carried key %q, want %q: one key per call, the same on every attempt", i, k, want)
		}
	}
	if len(uploads) != 3 || uploads[0] == "" || uploads[0] != uploads[2] {
		t.Errorf("stream attempts carried keys %q, want one key on all 3", uploads)
	}
	for _, bad := range []string{"Idempotency-Key", "grpc-key", "key-bin", "key with space", ""} {
		if _, err := New(WithIdempotencyKey(bad)); (err == nil) != (bad == "") {
			t.Errorf("WithIdempotencyKey(%q): New = %v", bad, err)
		}
	}
}
