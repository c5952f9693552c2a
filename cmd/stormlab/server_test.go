package stormlab

import (
	"context"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/internal/wire"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newTestServer is a Server whose clock moves only when the test
// advances it.
func newTestServer(t *testing.T, f Faults) (*Server, *testutil.Clock) {
	t.Helper()
	s, err := NewServer(f)
	if err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewClock(time.Unix(1000, 0))
	s.now = clk.Now
	s.reset(f)
	return s, clk
}

func retryCtx(n string) context.Context {
	return metadata.NewIncomingContext(context.Background(), metadata.Pairs(wire.AttemptKey, n))
}

func TestServerCountsByWindow(t *testing.T) {
	s, clk := newTestServer(t, Faults{Window: 100 * time.Millisecond})
	s.arrive(context.Background())
	s.arrive(retryCtx("2"))
	clk.Advance(250 * time.Millisecond)
	s.arrive(retryCtx("3"))
	s.arrive(retryCtx("3"))
	s.arrive(context.Background())
	st, _ := s.GetStats(context.Background(), nil)
	want := []struct{ first, retries int64 }{{1, 1}, {0, 0}, {1, 2}}
	if len(st.Windows) != len(want) {
		t.Fatalf("%d windows, want %d", len(st.Windows), len(want))
	}
	for i, w := range want {
		if st.Windows[i].FirstAttempts != w.first || st.Windows[i].Retries != w.retries {
			t.Errorf("window %d: %d first, %d retries; want %d, %d", i, st.Windows[i].FirstAttempts, st.Windows[i].Retries, w.first, w.retries)
		}
	}
	if st.Attempts != 5 || st.FirstAttempts != 2 || st.Retries != 3 || st.PeakRetries != 2 || st.PeakAttempts != 3 {
		t.Errorf("totals %+v", st)
	}
}

func TestServerTellsRetriesOfEveryClient(t *testing.T) {
	for _, tt := range []struct {
		md    metadata.MD
		retry bool
	}{
		{nil, false},
		{metadata.Pairs(wire.AttemptKey, "2"), true},
		{metadata.Pairs(wire.AttemptKey, "1"), false},
		{metadata.Pairs("grpc-previous-rpc-attempts", "1"), true},
		{metadata.Pairs("grpc-previous-rpc-attempts", "0"), false},
		{metadata.Pairs("x-retry-attempt", "1"), true},
		{metadata.Pairs("x-retry-attempt", "soon"), false},
	} {
		if got := isRetry(metadata.NewIncomingContext(context.Background(), tt.md)); got != tt.retry {
			t.Errorf("isRetry(%v) = %v, want %v", tt.md, got, tt.retry)
		}
	}
}

func TestServerSlidingPeakCountsAStraddlingWave(t *testing.T) {
	s, clk := newTestServer(t, Faults{Window: 100 * time.Millisecond})
	s.arrive(context.Background()) // at 0: the first arrival starts the clock
	clk.Advance(70 * time.Millisecond)
	for range 3 {
		s.arrive(retryCtx("2")) // at 70 ms: window 0
	}
	clk.Advance(60 * time.Millisecond)
	for range 4 {
		s.arrive(retryCtx("2")) // at 130 ms: window 1
	}
	st, _ := s.GetStats(context.Background(), nil)
	if st.PeakRetries != 4 || st.PeakRetriesSliding != 7 || st.PeakAttemptsSliding != 7 {
		t.Errorf("peaks: per window %d, any span %d/%d; want 4 and 7/7", st.PeakRetries, st.PeakRetriesSliding, st.PeakAttemptsSliding)
	}
	clk.Advance(100 * time.Millisecond)
	s.arrive(context.Background())
	st, _ = s.GetStats(context.Background(), nil)
	if st.PeakRetriesSliding != 7 || st.PeakAttemptsSliding != 7 {
		t.Errorf("a later arrival changed the peaks to %d/%d", st.PeakRetriesSliding, st.PeakAttemptsSliding)
	}
}

func TestServerOutageAndFailRate(t *testing.T) {
	s, clk := newTestServer(t, Faults{Outage: time.Second})
	if _, _, err := s.arrive(context.Background()); status.Code(err) != codes.Unavailable {
		t.Errorf("during the outage: %v, want Unavailable", err)
	}
	clk.Advance(time.Second)
	if _, _, err := s.arrive(context.Background()); err != nil {
		t.Errorf("after the outage: %v", err)
	}

	s, _ = newTestServer(t, Faults{FailRate: 0.3, Seed: 7})
	failed := 0
	for range 10000 {
		if _, _, err := s.arrive(context.Background()); err != nil {
			failed++
		}
	}
	if failed < 2800 || failed > 3200 {
		t.Errorf("%d of 10000 failed at rate 0.3", failed)
	}
	// the same seed fails the same attempts
	s2, _ := newTestServer(t, Faults{FailRate: 0.3, Seed: 7})
	again := 0
	for range 10000 {
		if _, _, err := s2.arrive(context.Background()); err != nil {
			again++
		}
	}
	if again != failed {
		t.Errorf("seed 7 failed %d, then %d: runs must repeat", failed, again)
	}
}

func TestServerOverloadRecoversOnlyAfterCalm(t *testing.T) {
	const w = 100 * time.Millisecond
	s, clk := newTestServer(t, Faults{Capacity: 3, CapacityWindow: w, RecoverAfter: 3 * w, Window: w})
	arrive := func(n int) (failed int) {
		for range n {
			if _, _, err := s.arrive(context.Background()); err != nil {
				failed++
			}
		}
		return failed
	}
	if f := arrive(3); f != 0 {
		t.Fatalf("within capacity: %d failed", f)
	}
	if f := arrive(2); f != 2 {
		t.Fatalf("over capacity: %d of 2 failed, want 2", f)
	}
	// windows 1 and 2 within capacity, window 3 over: the calm starts again
	clk.Advance(w)
	arrive(1)
	clk.Advance(w)
	arrive(1)
	clk.Advance(w)
	if f := arrive(4); f != 4 {
		t.Fatalf("still overloaded: %d of 4 failed", f)
	}
	// three calm windows (4, 5, 6), then it takes work again
	clk.Advance(w)
	if f := arrive(2); f != 2 {
		t.Fatalf("calm is not yet long enough: %d of 2 failed", f)
	}
	clk.Advance(3 * w)
	if f := arrive(3); f != 0 {
		t.Fatalf("after 3 calm windows: %d of 3 failed, want 0", f)
	}
	st, _ := s.GetStats(context.Background(), nil)
	if st.RecoveredMs != 700 {
		t.Errorf("recovered at %d ms, want 700", st.RecoveredMs)
	}
	if st.OverloadedMs != 700 {
		t.Errorf("overloaded for %d ms, want 700", st.OverloadedMs)
	}
}

func TestServerChargesOncePerKey(t *testing.T) {
	s, _ := newTestServer(t, Faults{})
	a, err := s.Charge(context.Background(), &demov1.ChargeRequest{IdempotencyKey: "k1", AmountCents: 5})
	if err != nil || a.Duplicate {
		t.Fatalf("first charge: %v, %v", a, err)
	}
	b, err := s.Charge(context.Background(), &demov1.ChargeRequest{IdempotencyKey: "k1", AmountCents: 5})
	if err != nil || !b.Duplicate || b.ChargeId != a.ChargeId {
		t.Fatalf("repeated key: %v, %v; want a duplicate of %s", b, err, a.ChargeId)
	}
	if _, err := s.Charge(context.Background(), &demov1.ChargeRequest{AmountCents: 0}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("zero amount: %v, want InvalidArgument", err)
	}
	st, _ := s.GetStats(context.Background(), nil)
	if st.DuplicatesRefused != 1 {
		t.Errorf("duplicates refused %d, want 1", st.DuplicatesRefused)
	}
}

func TestFaultsValidate(t *testing.T) {
	for _, f := range []Faults{{FailRate: 1.5}, {FailRate: -1}, {LostReplyRate: 2}, {Outage: -1}, {Capacity: -1}, {Window: -1}} {
		if f.Validate() == nil {
			t.Errorf("Validate(%+v) = nil", f)
		}
		if _, err := NewServer(f); err == nil {
			t.Errorf("NewServer(%+v) accepted it", f)
		}
	}
}

// startServer serves a gateway on 127.0.0.1 until the test ends.
func startServer(t *testing.T, f Faults) (*Server, string) {
	t.Helper()
	s, addr, stop, err := ServeLoopback(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return s, addr
}

func TestServerOverGRPC(t *testing.T) {
	_, addr := startServer(t, Faults{})
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	c := demov1.NewGatewayServiceClient(cc)
	ctx := context.Background()
	if _, err := c.ResetStats(ctx, &demov1.ResetStatsRequest{Faults: (&Faults{Outage: time.Hour}).Proto()}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Charge(ctx, &demov1.ChargeRequest{IdempotencyKey: "a", AmountCents: 1}); status.Code(err) != codes.Unavailable {
		t.Errorf("during an outage set by ResetStats: %v", err)
	}
	if _, err := c.ResetStats(ctx, &demov1.ResetStatsRequest{Faults: &demov1.Faults{}}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "a"} {
		if _, err := c.Charge(ctx, &demov1.ChargeRequest{IdempotencyKey: k, AmountCents: 1}); err != nil {
			t.Fatal(err)
		}
	}
	stream, err := c.ListCharges(ctx, &demov1.ListChargesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		if _, err := stream.Recv(); err != nil {
			break
		}
		n++
	}
	if n != 2 {
		t.Errorf("listed %d charges, want 2 (one key was repeated)", n)
	}
	up, err := c.UploadReceipts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	up.Send(&demov1.UploadReceiptsRequest{Receipt: []byte("abc")})
	up.Send(&demov1.UploadReceiptsRequest{Receipt: []byte("de")})
	resp, err := up.CloseAndRecv()
	if err != nil || resp.Receipts != 2 || resp.Bytes != 5 {
		t.Errorf("upload: %v, %v; want 2 receipts, 5 bytes", resp, err)
	}
	st, _ := c.GetStats(ctx, &demov1.GetStatsRequest{})
	if st.Attempts != 5 || st.DuplicatesRefused != 1 {
		t.Errorf("stats: %d attempts, %d duplicates; want 5 and 1 (control calls are not counted)", st.Attempts, st.DuplicatesRefused)
	}
	if _, err := c.ResetStats(ctx, &demov1.ResetStatsRequest{Faults: &demov1.Faults{FailRate: 3}}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("bad faults: %v, want InvalidArgument", err)
	}
}
