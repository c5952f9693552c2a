package stormlab

import (
	"bytes"
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/internal/wire"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// serveTier serves a tier forwarding to next with dial on 127.0.0.1 until
// the test ends, and returns its address.
func serveTier(t *testing.T, next string, dial []grpc.DialOption, opts ...grpc.ServerOption) string {
	t.Helper()
	tier, err := NewTier(next, dial)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := tier.Register(opts...)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	t.Cleanup(func() { g.Stop(); <-done; tier.Close() })
	return lis.Addr().String()
}

// TestTierForwardsStatusAndDeadline: through two in-process tiers (three
// hops), a charge reaches the leaf with a deadline within the user's, a
// retry of the user's is counted at the leaf as made for a retry above,
// and the leaf's status codes come back to the user as they were.
func TestTierForwardsStatusAndDeadline(t *testing.T) {
	leaf, leafAddr, stop, err := ServeLoopback(Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	gateway := serveTier(t, serveTier(t, leafAddr, nil), nil)
	cc, err := grpc.NewClient(gateway, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(StampUserDeadline()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	client := demov1.NewGatewayServiceClient(cc)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	user, _ := ctx.Deadline()
	if _, err := client.Charge(ctx, &demov1.ChargeRequest{AmountCents: 100}); err != nil {
		t.Fatalf("charge through the tiers: %v", err)
	}
	d := leaf.Deadlines()
	if d.Stamped != 1 || d.None != 0 || d.Late != 0 {
		t.Errorf("leaf deadlines %+v, want one attempt with a deadline within the user's", d)
	}
	// Propagated, the leaf's deadline is the user's plus the hops' transit;
	// a tier that made its own (the user's 3 s afresh) would be late by
	// about the time the call had already taken, and one with none would
	// have no deadline.
	if d.MaxExcess > DeadlineSlack || d.MaxExcess < -DeadlineSlack {
		t.Errorf("the leaf's deadline was %v past the user's (%v): want within %v", d.MaxExcess, user, DeadlineSlack)
	}
	if n := leaf.RetriedAbove(); n != 0 {
		t.Errorf("a first attempt through the tiers: the leaf counted %d attempts for retries above, want 0", n)
	}
	// A retry of the user's, in each client's words, is marked at the
	// gateway and passed on by the service: the leaf counts it. A first
	// attempt in the same words is not.
	for i, kv := range [][2]string{
		{wire.AttemptKey, "2"}, {"grpc-previous-rpc-attempts", "1"}, {"x-retry-attempt", "1"},
		{wire.AttemptKey, "1"}, {"grpc-previous-rpc-attempts", "0"}, {"x-retry-attempt", "0"},
	} {
		want := int64(min(i+1, 3))
		if _, err := client.Charge(metadata.AppendToOutgoingContext(ctx, kv[0], kv[1]), &demov1.ChargeRequest{AmountCents: 100}); err != nil {
			t.Fatalf("charge with %s: %v", kv, err)
		}
		if n := leaf.RetriedAbove(); n != want {
			t.Errorf("after a charge with %s: the leaf counted %d attempts for retries above, want %d", kv, n, want)
		}
	}
	d = leaf.Deadlines()
	if got, err := ReadLeafCounts(ctx, client); status.Code(err) != codes.Unimplemented {
		t.Errorf("GetStats at a tier = %+v, %v: want Unimplemented (counts are the leaf's)", got, err)
	}
	ctl := demov1.NewGatewayServiceClient(dialLoopback(t, leafAddr))
	if got, err := ReadLeafCounts(ctx, ctl); err != nil || got != (LeafCounts{Deadlines: d, RetriedAbove: 3}) {
		t.Errorf("ReadLeafCounts at the leaf = %+v, %v: want %+v and 3 retried above", got, err, d)
	}

	// The status codes are kept: the leaf's own answer, and its faults'.
	if _, err := client.Charge(ctx, &demov1.ChargeRequest{AmountCents: 0}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("charge of 0 through the tiers: %v, want InvalidArgument", err)
	}
	if _, err := ctl.ResetStats(ctx, &demov1.ResetStatsRequest{Faults: Faults{FailRate: 1}.Proto()}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Charge(ctx, &demov1.ChargeRequest{AmountCents: 100}); status.Code(err) != codes.Unavailable {
		t.Errorf("charge through the tiers to a failing leaf: %v, want Unavailable", err)
	}
	short, cancelShort := context.WithTimeout(ctx, time.Millisecond)
	defer cancelShort()
	<-short.Done()
	if _, err := client.Charge(short, &demov1.ChargeRequest{AmountCents: 100}); status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("charge with a spent deadline: %v, want DeadlineExceeded", err)
	}
	if s, _ := ctl.GetStats(ctx, &demov1.GetStatsRequest{}); s.GetAttempts() != 1 {
		t.Errorf("the leaf saw %d attempts since the reset, want 1: no tier retries without a strategy", s.GetAttempts())
	}
	if n := leaf.RetriedAbove(); n != 0 {
		t.Errorf("after a reset the leaf counts %d attempts for retries above, want 0", n)
	}
}

func dialLoopback(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func TestDeadlineCountsRoundTripAndShare(t *testing.T) {
	var d DeadlineCounts
	user := time.Unix(100, 0)
	d.add(user.Add(-time.Second), true, user, true)
	d.add(user.Add(3*time.Millisecond), true, user, true)
	d.add(user.Add(2*time.Second), true, user, true)
	d.add(time.Time{}, false, time.Time{}, false)
	d.add(user, true, time.Time{}, false) // no stamp: not judged
	want := DeadlineCounts{Stamped: 3, None: 1, Late: 1, MaxExcess: 2 * time.Second}
	if d != want {
		t.Errorf("counts %+v, want %+v", d, want)
	}
	if got := d.Within(); got < 66.6 || got > 66.7 {
		t.Errorf("Within = %v, want 2 of 3", got)
	}
	back, err := ParseDeadlineCounts(d.String())
	if err != nil || back != d {
		t.Errorf("ParseDeadlineCounts(%q) = %+v, %v", d.String(), back, err)
	}
	if _, err := ParseDeadlineCounts("x"); err == nil {
		t.Error("ParseDeadlineCounts(x): want an error")
	}
}

func TestMeshStrategiesPerHop(t *testing.T) {
	names := map[string]bool{}
	for _, ms := range MeshStrategies() {
		names[ms.Name] = true
		if got, ok := MeshStrategyNamed(strings.ToUpper(ms.Name)); !ok || got.Name != ms.Name {
			t.Errorf("MeshStrategyNamed(%q) = %q, %v", ms.Name, got.Name, ok)
		}
		if ms.External != "" {
			if _, _, err := ms.hopClient(2, 1, nil, nil); err == nil {
				t.Errorf("%s without its peer: want an error", ms.Name)
			}
			continue
		}
		for h := 1; h <= MeshDepth; h++ {
			st := ms.Hop(h)
			retries := st.Peer != nil || st.Policy.MaxAttempts != 1
			want := ms.Name != MeshNoRetries && (ms.Name != MeshLastHop || h == MeshDepth)
			if retries != want {
				t.Errorf("%s, hop %d: retries %v, want %v", ms.Name, h, retries, want)
			}
		}
	}
	if len(names) != 6 {
		t.Errorf("%d mesh strategies, want 6", len(names))
	}
	if _, ok := MeshScenariosNamed("tsunami"); ok {
		t.Error(`MeshScenariosNamed("tsunami"): want unknown`)
	}
}

func TestWriteMeshTableAndSVG(t *testing.T) {
	sc := SteadyOutage()
	run := func(name string, leaf int64, ok int) MeshResult {
		st := &Steady{Rate: 100, Bucket: DefaultBucket, TriggerStart: 3 * time.Second, TriggerEnd: 4 * time.Second}
		for i := range 100 {
			o := "ok"
			if i >= ok {
				o = "error Unavailable"
			}
			st.Calls = append(st.Calls, Completion{Start: time.Duration(i) * 10 * time.Millisecond, End: time.Duration(i)*10*time.Millisecond + time.Millisecond, Outcome: o})
		}
		return MeshResult{Result: Result{Strategy: name, Calls: 100, Succeeded: ok, Steady: st,
			Stats: &demov1.GetStatsResponse{Attempts: leaf, WindowMs: 100, Windows: []*demov1.Window{{FirstAttempts: 10}, {FirstAttempts: 10, Retries: 20}}}},
			Deadlines: DeadlineCounts{Stamped: leaf, MaxExcess: time.Millisecond}, RetriedAbove: max(leaf-103, 0)}
	}
	rows := []MeshSummary{
		SummarizeMesh(run(MeshGRPCRetry, 900, 25)),
		SummarizeMesh(run(MeshServerHalf, 105, 99)),
		SummarizeMesh(run(MeshLastHop, 100, 99)),
	}
	var b bytes.Buffer
	if err := WriteMeshTable(&b, sc, rows); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	// gRPC's retry: 9 leaf attempts per call, 7.97 of them for retries
	// above; the server half 1.05 times the last hop only's.
	for _, want := range []string{"9.00", "7.97", "1.05", "every one of the leaf's 1105 attempts", "100.0 % (latest 1ms past)"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if errs := MeshHarm(rows); len(errs) != 0 {
		t.Errorf("MeshHarm = %v, want none", errs)
	}
	lo, mid, hi := run(MeshGRPCRetry, 900, 25), run(MeshGRPCRetry, 900, 25), run(MeshGRPCRetry, 900, 25)
	lo.RetriedAbove, mid.RetriedAbove = 0, 500
	if got := SummarizeMesh(hi, lo, mid).RetriedAbovePerCall; got != 5 {
		t.Errorf("the median of 0, 5 and 7.97 leaf attempts per call for retries above = %v, want 5", got)
	}
	rows[1] = SummarizeMesh(run(MeshServerHalf, 120, 90))
	if errs := MeshHarm(rows); len(errs) != 2 {
		t.Errorf("MeshHarm of 1.2 x the attempts and 9 points fewer ok = %v, want both", errs)
	}
	b.Reset()
	if err := WriteMeshSVG(&b, []MeshSection{{Title: "outage", Rows: rows}, {Title: "empty"}}); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	// 10 attempts per window of 10 calls, then 30: 1 and 3 per call.
	if strings.Count(svg, "<polyline") != 3 || !strings.Contains(svg, "trigger") || strings.Contains(svg, "empty") {
		t.Errorf("svg: want 3 lines, the trigger and no empty section:\n%s", svg)
	}
}

// runMesh runs the mesh strategies named in sc at scale, in turn, on lab.
func runMesh(t *testing.T, lab *MeshLab, sc Scenario, scale float64, names ...string) map[string]MeshResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := map[string]MeshResult{}
	for _, n := range names {
		ms, ok := MeshStrategyNamed(n)
		if !ok {
			t.Fatalf("no mesh strategy %q", n)
		}
		r, err := lab.Run(ctx, sc, ms, scale)
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		t.Logf("%-32s leaf attempts/call %.2f (%.2f for retries above), ok %d of %d, deadlines %+v, outcomes %v", n, r.AttemptsPerCall(), r.RetriedAbovePerCall(), r.Succeeded, r.Calls, r.Deadlines, r.Outcomes)
		out[n] = r
	}
	return out
}

// TestTimingMeshOutageShapes runs the chain in this process through the
// leaf's outage: gRPC's retry at every hop multiplies the leaf's attempts
// per user call well above those of herdguard at the last hop only, most
// of them made for retries above the leaf's caller, and the server half
// keeps them within 1.1 times, with next to none for retries above, and
// as many calls ok less 2 points. It counts arrivals in 50 ms windows:
// make timing runs it without the race detector.
//
// The whole chain shares this process's cores, so it goes at scale 1
// (600 user calls/s). At scale 2 a CI machine a little slower than this
// one starved the chain of CPU and the comparison measured the machine:
// the server half got 92.0 % ok against 97.7 %. With a busy loop beside
// it on 2 cores, scale 2 put the server half 2.4-17 points behind the
// last hop only in 4 runs of 5; scale 1 put it within 0.4 points in 4 of
// 4. Idle, gRPC's retry is calmer at scale 1 too: its propagated
// deadlines ran at most 113 ms late (145-197 ms at scale 2). With the busy
// loop, both scales let a few of its 60 000 attempts run past
// DeadlineSlack (up to 341 ms): on a machine that much slower this test
// fails on the control's deadlines.
func TestTimingMeshOutageShapes(t *testing.T) {
	testutil.Timing(t, raceEnabled, "counts arrivals in 50 ms windows")
	if testing.Short() {
		t.Skip("the mesh runs take about 40 s")
	}
	rs := runMesh(t, &MeshLab{}, SteadyOutage(), 1, MeshGRPCRetry, MeshServerHalf, MeshLastHop)
	grpcRetry, half, last := rs[MeshGRPCRetry], rs[MeshServerHalf], rs[MeshLastHop]
	if g, l := grpcRetry.AttemptsPerCall(), last.AttemptsPerCall(); g < 3*l {
		t.Errorf("gRPC retry at every layer: %.2f leaf attempts per user call, the last hop only %.2f: want at least 3 times", g, l)
	}
	if h, l := half.AttemptsPerCall(), last.AttemptsPerCall(); h > 1.1*l {
		t.Errorf("the server half: %.2f leaf attempts per user call, the last hop only %.2f: want at most 1.1 times", h, l)
	}
	// Where the multiplication comes from: gRPC's retry above the leaf's
	// caller makes most of its leaf attempts; the server half's layers
	// above retry nothing the leaf sees (a transport blip is allowed 1 in
	// 100 calls); and above the last hop only no layer retries at all.
	if a, n := grpcRetry.RetriedAbove, grpcRetry.Stats.GetAttempts(); 2*a < n {
		t.Errorf("gRPC retry at every layer: %d of the leaf's %d attempts made for retries above the leaf's caller: want at least half", a, n)
	}
	if a := half.RetriedAbovePerCall(); a > 0.01 {
		t.Errorf("the server half: %.3f leaf attempts per user call made for retries above the leaf's caller: want at most 0.01", a)
	}
	if a := last.RetriedAbove; a != 0 {
		t.Errorf("the last hop only: %d leaf attempts made for retries above the leaf's caller: want none", a)
	}
	if h, l := okShare(half.Result), okShare(last.Result); h < l-2 {
		t.Errorf("the server half: %.1f %% of calls ok, the last hop only %.1f %%: want at most 2 points fewer", h, l)
	}
	for n, r := range rs {
		if r.Deadlines.Stamped != r.Stats.GetAttempts() || r.Deadlines.Late != 0 {
			t.Errorf("%s: of the leaf's %d attempts, %d carried the user's deadline and %d were late: want every one within it", n, r.Stats.GetAttempts(), r.Deadlines.Stamped, r.Deadlines.Late)
		}
	}
}

func okShare(r Result) float64 { return 100 * float64(r.Succeeded) / float64(max(r.Calls, 1)) }

// TestMeshProcesses builds the demo server and runs the chain as four
// processes, briefly: sending no retries, the leaf receives at most one
// attempt per user call, each with the user's deadline; every process
// stops on SIGTERM (Run fails if one has to be killed).
func TestMeshProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the demo server and starts 12 processes")
	}
	bin := filepath.Join(t.TempDir(), "demo-server")
	build := exec.Command("go", "build", "-o", bin, "github.com/herdguard/herdguard/cmd/demo-server")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	lab := &MeshLab{ServerBin: bin}
	sc := SteadyOutage()
	sc.Rate, sc.Duration = 100, 6*time.Second // 600 calls in 1.5 s at scale 4
	rs := runMesh(t, lab, sc, 4, MeshNoRetries, MeshServerHalf)
	for n, r := range rs {
		if r.Succeeded == 0 || r.Stats.GetAttempts() < int64(r.Succeeded) {
			t.Errorf("%s: %d calls ok, %d leaf attempts: want calls through the chain", n, r.Succeeded, r.Stats.GetAttempts())
		}
		if r.Deadlines.Stamped != r.Stats.GetAttempts() || r.Deadlines.Late != 0 || r.Deadlines.None != 0 {
			t.Errorf("%s: leaf deadlines %+v of %d attempts: want every one within the user's", n, r.Deadlines, r.Stats.GetAttempts())
		}
	}
	if none := rs[MeshNoRetries]; none.Stats.GetAttempts() > int64(none.Calls) || none.Stats.GetRetries() != 0 {
		t.Errorf("no retries: the leaf saw %d attempts (%d retries) for %d user calls: want at most one each", none.Stats.GetAttempts(), none.Stats.GetRetries(), none.Calls)
	}
	// A strategy whose tiers need a binary the lab was not given fails to
	// start, and says which.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := lab.Run(ctx, sc, mustMesh(t, MeshGGM), 4); err == nil || !strings.Contains(err.Error(), "ggm-tier") {
		t.Errorf("go-grpc-middleware without its binary: %v, want an error naming ggm-tier", err)
	}
}

func mustMesh(t *testing.T, name string) MeshStrategy {
	t.Helper()
	ms, ok := MeshStrategyNamed(name)
	if !ok {
		t.Fatalf("no mesh strategy %q", name)
	}
	return ms
}
