package stormlab

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testutil"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

const ms = time.Millisecond

// step is one moment of a fault-model test: move the server's clock on by
// after, then let attempts arrive, each expected to fail or to be queued
// for the given wait.
type step struct {
	after time.Duration
	waits []time.Duration // per attempt; -1 = fails at once
}

func runSteps(t *testing.T, s *Server, clk *testutil.Clock, steps []step) {
	t.Helper()
	var at time.Duration
	for i, st := range steps {
		clk.Advance(st.after)
		at += st.after
		for j, want := range st.waits {
			_, queued, err := s.arrive(context.Background())
			got := queued
			if err != nil {
				if status.Code(err) != codes.Unavailable {
					t.Fatalf("step %d (at %v), attempt %d: %v, want Unavailable", i, at, j, err)
				}
				got = -1
			}
			if got != want {
				t.Errorf("step %d (at %v), attempt %d: waits %v (-1: fails), want %v", i, at, j, got, want)
			}
		}
	}
}

func TestGentleQueue(t *testing.T) {
	// 10 attempts per 100 ms: one service slot every 10 ms.
	base := Faults{Model: ModelGentle, Capacity: 10, CapacityWindow: 100 * ms, QueueLimit: 35 * ms}
	tests := []struct {
		name  string
		f     Faults
		steps []step
	}{
		{"admitted attempts wait their turn, 10 ms apart; the excess fails at once", base, []step{
			{0, []time.Duration{10 * ms, 20 * ms, 30 * ms, -1, -1}},
			// a failed attempt took no slot: the queue ends at 30 ms
			{20 * ms, []time.Duration{20 * ms, 30 * ms, -1}},
			// once the queue has drained, an attempt waits one service time
			{100 * ms, []time.Duration{10 * ms}},
		}},
		{"the default queue limit is ten windows", Faults{Model: ModelGentle, Capacity: 1, CapacityWindow: 100 * ms}, []step{
			{0, []time.Duration{100 * ms, 200 * ms, 300 * ms, 400 * ms, 500 * ms, 600 * ms, 700 * ms, 800 * ms, 900 * ms, time.Second, -1}},
		}},
		{"a trigger's capacity spaces the slots while it lasts", func() Faults {
			f := base
			f.TriggerAt, f.TriggerFor, f.TriggerCapacity = 100*ms, 200*ms, 2 // one slot every 50 ms
			f.QueueLimit = 60 * ms
			return f
		}(), []step{
			{0, []time.Duration{10 * ms}},
			{100 * ms, []time.Duration{50 * ms, -1}}, // the next slot, 100 ms away, is beyond the limit
			{200 * ms, []time.Duration{10 * ms}},     // at 300 ms the trigger has ended
		}},
		{"an outage trigger fails everything while it lasts", func() Faults {
			f := base
			f.TriggerAt, f.TriggerFor, f.TriggerOutage = 100*ms, 100*ms, true
			return f
		}(), []step{
			{0, []time.Duration{10 * ms}},
			{100 * ms, []time.Duration{-1, -1}},
			{99 * ms, []time.Duration{-1}},
			{1 * ms, []time.Duration{10 * ms, 20 * ms}},
		}},
		{"without a capacity the gentle server takes everything at once", Faults{Model: ModelGentle}, []step{
			{0, []time.Duration{0, 0, 0}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, clk := newTestServer(t, tt.f)
			runSteps(t, s, clk, tt.steps)
			if st, _ := s.GetStats(context.Background(), nil); st.Overloaded || st.OverloadedMs != 0 {
				t.Errorf("the gentle server reports a sticky overload: %v, %d ms", st.Overloaded, st.OverloadedMs)
			}
		})
	}
}

func TestStickyTrigger(t *testing.T) {
	// 3 attempts per 100 ms window; 2 calm windows end an overload.
	base := Faults{Capacity: 3, CapacityWindow: 100 * ms, RecoverAfter: 200 * ms, Window: 100 * ms}
	cut := base
	cut.TriggerAt, cut.TriggerFor, cut.TriggerCapacity = 300*ms, 200*ms, 1
	outage := base
	outage.TriggerAt, outage.TriggerFor, outage.TriggerOutage = 200*ms, 100*ms, true
	tests := []struct {
		name      string
		f         Faults
		steps     []step
		recovered int64 // ms, -1 = never overloaded or still down
	}{
		{"a cut lowers the capacity while it lasts, and its overload needs the calm after", cut, []step{
			{0, []time.Duration{0, 0, 0}},
			{300 * ms, []time.Duration{0, -1}}, // capacity 1 from 300 ms
			{100 * ms, nil},                    // a calm window in the trigger
			{100 * ms, []time.Duration{-1}},    // 500 ms: the trigger is over, the calm only 100 ms long
			{100 * ms, []time.Duration{0, 0, 0}},
		}, 600},
		{"an outage fails even the first attempt in it", outage, []step{
			{0, []time.Duration{0}},
			{250 * ms, []time.Duration{-1}},
			{50 * ms, []time.Duration{-1}},  // 300 ms: over, but the outage's window was not calm
			{100 * ms, []time.Duration{-1}}, // the calm started at 300 ms
			{100 * ms, []time.Duration{0}},
		}, 500},
		{"an outage with nothing arriving is calm for the sticky server", outage, []step{
			{0, []time.Duration{0}},
			{300 * ms, []time.Duration{0, 0, 0}},
		}, -1},
		{"before the trigger the normal capacity applies", cut, []step{
			{0, []time.Duration{0, 0, 0, -1}},
		}, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, clk := newTestServer(t, tt.f)
			runSteps(t, s, clk, tt.steps)
			if st, _ := s.GetStats(context.Background(), nil); st.RecoveredMs != tt.recovered {
				t.Errorf("recovered at %d ms, want %d", st.RecoveredMs, tt.recovered)
			}
		})
	}
}

func TestClockStartsAtFirstArrival(t *testing.T) {
	f := Faults{Outage: time.Second, Window: 100 * ms}
	s, clk := newTestServer(t, f)
	clk.Advance(5 * time.Second) // nothing happens between the reset and the first arrival
	if _, _, err := s.arrive(context.Background()); status.Code(err) != codes.Unavailable {
		t.Fatalf("first arrival, 5 s after the reset: %v; the 1 s outage must start with it", err)
	}
	clk.Advance(999 * ms)
	if _, _, err := s.arrive(context.Background()); err == nil {
		t.Fatal("999 ms after the first arrival: the outage is over already")
	}
	clk.Advance(ms)
	if _, _, err := s.arrive(context.Background()); err != nil {
		t.Fatalf("1 s after the first arrival: %v", err)
	}
	st, _ := s.GetStats(context.Background(), nil)
	if len(st.Windows) != 11 || st.Windows[0].Failed != 1 || st.Windows[9].Failed != 1 || st.Windows[10].FirstAttempts != 1 {
		t.Errorf("windows %v: want 11, counted from the first arrival", st.Windows)
	}

	// a reset stops the clock again, and a trigger counts from the next arrival
	s.reset(Faults{Capacity: 5, TriggerAt: 200 * ms, TriggerFor: 100 * ms, TriggerOutage: true, Window: 100 * ms})
	clk.Advance(time.Hour)
	runSteps(t, s, clk, []step{{0, []time.Duration{0}}, {199 * ms, []time.Duration{0}}, {ms, []time.Duration{-1}}})
}

func TestServerCountsSuccessesPerWindow(t *testing.T) {
	s, clk := newTestServer(t, Faults{Capacity: 2, Window: 100 * ms})
	for range 3 {
		w, _, err := s.arrive(context.Background())
		if err == nil {
			s.finish(w, nil)
		}
	}
	clk.Advance(100 * ms)
	st, _ := s.GetStats(context.Background(), nil)
	if got := st.Windows[0]; got.Succeeded != 2 || got.Failed != 1 {
		t.Errorf("window 0: %d succeeded, %d failed; want 2 and 1", got.Succeeded, got.Failed)
	}
}

func TestSleepEndsWithTheCaller(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := sleep(ctx, time.Hour); status.Code(err) != codes.Canceled {
		t.Errorf("sleep with an ended context: %v, want Canceled at once", err)
	}
	if err := sleep(ctx, 0); err != nil {
		t.Errorf("sleep 0: %v", err)
	}
}

func TestFaultsValidateNamesFieldAndValue(t *testing.T) {
	tests := []struct {
		f    Faults
		want string
	}{
		{Faults{FailRate: 1.5}, "FailRate = 1.5"},
		{Faults{SlowRate: -0.1}, "SlowRate = -0.1"},
		{Faults{Outage: -ms}, "Outage = -1ms"},
		{Faults{Capacity: -1}, "Capacity = -1"},
		{Faults{Model: "bouncy"}, `Model = "bouncy"`},
		{Faults{QueueLimit: -ms}, "QueueLimit = -1ms"},
		{Faults{TriggerAt: -ms, TriggerFor: ms, TriggerOutage: true}, "TriggerAt = -1ms"},
		{Faults{TriggerFor: -ms}, "TriggerFor = -1ms"},
		{Faults{TriggerFor: time.Second, TriggerCapacity: -1}, "TriggerCapacity = -1"},
		{Faults{TriggerFor: time.Second}, "TriggerCapacity = 0"},
		{Faults{TriggerAt: time.Second, TriggerOutage: true}, "TriggerFor = 0"},
	}
	for _, tt := range tests {
		err := tt.f.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tt.f, err, tt.want)
		}
	}
	for _, f := range []Faults{{}, {Model: ModelSticky}, {Model: ModelGentle, Capacity: 3}, SteadyCut().Faults, SteadyOutage().Faults, SteadyGentle().Faults} {
		if err := f.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v", f, err)
		}
	}
}

func TestFaultsProtoRoundTrip(t *testing.T) {
	// Exact at every scale, 1.5 and 3 included (a 100 ms window is then
	// no whole number of milliseconds or microseconds): the server runs
	// the faults the client scaled and bounds.
	for _, scale := range []float64{1, 1.5, 2, 3, 4} {
		for _, sc := range append(SteadyScenarios(), Herd(20), Published(), SlowAttempts()) {
			f := sc.Scale(scale).Faults
			if got := FaultsFromProto(f.Proto()); got != f {
				t.Errorf("%s at scale %v: round trip\n got %+v\nwant %+v", sc.Name, scale, got, f)
			}
		}
	}
}

func TestScaleSteady(t *testing.T) {
	got := SteadyCut().Scale(4)
	f := got.Faults
	if got.Rate != 2400 || got.Duration != 3*time.Second || got.Deadline != 500*ms || got.Bucket != 62500*time.Microsecond ||
		f.QueueLimit != 250*ms || f.TriggerAt != 750*ms || f.TriggerFor != 500*ms || f.CapacityWindow != 25*ms || f.RecoverAfter != 250*ms ||
		f.Capacity != 80 || f.TriggerCapacity != 30 || got.steadyCalls() != 7200 {
		t.Errorf("SteadyCut().Scale(4) = %+v", got)
	}
	// the load per window stays the same
	if full := SteadyCut(); full.Rate*full.Faults.CapacityWindow.Seconds() != got.Rate*f.CapacityWindow.Seconds() {
		t.Errorf("calls per window: %v at full scale, %v at 1/4", full.Rate*full.Faults.CapacityWindow.Seconds(), got.Rate*f.CapacityWindow.Seconds())
	}
	if b := (Scenario{Rate: 10, Duration: time.Second}).Scale(2).Bucket; b != DefaultBucket/2 {
		t.Errorf("a zero Bucket scales from the default: %v", b)
	}
}

func TestHerdBound(t *testing.T) {
	tests := []struct {
		c        int
		attempts int
		last     time.Duration
	}{
		// The first window and 1 s of calm, then the last success as the
		// last window the retries need begins.
		{20, 1980, 5900 * ms},  // 1.0 s + 49 windows
		{80, 1920, 2200 * ms},  // 1.0 s + 12 windows (920/80 rounded up)
		{320, 1680, 1300 * ms}, // 1.0 s + 3 windows
		{1000, 1000, 0},        // everything in the first window
	}
	for _, tt := range tests {
		b, ok := Herd(tt.c).Bound()
		if !ok || b.Attempts != tt.attempts || b.LastSuccess != tt.last || b.OK != 1000 {
			t.Errorf("Herd(%d).Bound() = %+v, %v; want %d attempts, last success %v", tt.c, b, ok, tt.attempts, tt.last)
		}
		if b4, _ := Herd(tt.c).Scale(4).Bound(); b4.LastSuccess != tt.last/4 {
			t.Errorf("Herd(%d) at scale 4: last success %v, want %v", tt.c, b4.LastSuccess, tt.last/4)
		}
	}
	if _, ok := Published().Bound(); ok {
		t.Error("the published scenario has a bound")
	}
}

// TestHerdBoundIsReached: a client that knew the sticky server sends the
// herd, then each window's worth of the calls turned away as the server
// can take them, and reaches the herd's bound exactly: no client can do
// better, and this one does as well.
func TestHerdBoundIsReached(t *testing.T) {
	for _, c := range []int{20, 80, 320} {
		sc := Herd(c)
		s, clk := newTestServer(t, sc.Faults)
		ok := 0
		send := func(ctx context.Context, n int) {
			for range n {
				if w, _, err := s.arrive(ctx); err == nil {
					s.finish(w, nil)
					ok++
				}
			}
		}
		send(context.Background(), sc.Calls)
		clk.Advance(sc.Faults.CapacityWindow + sc.Faults.RecoverAfter) // recovered
		for left := sc.Calls - c; left > 0; left -= c {
			send(retryCtx("2"), min(c, left))
			if left > c {
				clk.Advance(sc.Faults.CapacityWindow)
			}
		}
		st, err := s.GetStats(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := sc.Bound()
		if last := time.Duration(st.GetLastSuccessMs()) * ms; ok != b.OK || st.GetAttempts() != int64(b.Attempts) || last != b.LastSuccess {
			t.Errorf("C = %d: %d ok, %d attempts, last success %v; the bound says %d, %d and %v",
				c, ok, st.GetAttempts(), last, b.OK, b.Attempts, b.LastSuccess)
		}
	}
}

func TestSteadyBound(t *testing.T) {
	// 100 calls, one every 10 ms, each with 100 ms to live; the gentle
	// server takes 10 per 100 ms but nothing from 200 to 500 ms: the calls
	// started from 200 to 400 ms expire before it is back, the rest get
	// through, oldest first.
	sc := Scenario{Rate: 100, Duration: time.Second, Deadline: 100 * ms,
		Faults: Faults{Model: ModelGentle, Capacity: 10, CapacityWindow: 100 * ms, TriggerAt: 200 * ms, TriggerFor: 300 * ms, TriggerOutage: true}}
	if b, ok := sc.Bound(); !ok || b.OK != 80 || b.Calls != 100 || b.Attempts != 100 {
		t.Errorf("Bound() = %+v, %v; want 80 of 100 ok", b, ok)
	}
	// The sticky server cannot be warned: the trigger's first window
	// overloads it, and it needs its calm before taking work again. With
	// 2 s deadlines a knowing client still holds every call until then.
	for _, sc := range SteadyScenarios() {
		if b, _ := sc.Bound(); b.OK != 7200 {
			t.Errorf("%s: best %d of 7200", sc.Name, b.OK)
		}
	}
	// The trigger's first window serves the cut's 30 before the rest of it
	// overloads the server. With 100 ms deadlines (a call is served in its
	// window or the next) the knowing client loses the other 30 of that
	// window, every call of 3.1-4.0 s (540) while the server is down until
	// 4.1 s, and half of those of 4.0-4.9 s (270) while the cut takes 30 of
	// each window's 60: 840 of 7200.
	// The same at the scales whose window divides the trigger's times.
	// (At 1.5 and 3 the bound takes the trigger's first window to be the
	// first that starts at or after it, as the server does, but call starts
	// and deadlines, rounded to nanoseconds, then meet window edges a
	// nanosecond apart: 6330.)
	for _, scale := range []float64{1, 2, 4} {
		short := SteadyCut().Scale(scale)
		short.Deadline = time.Duration(float64(100*ms) / scale)
		if b, _ := short.Bound(); b.OK != 6360 {
			t.Errorf("sticky cut at scale %v, deadlines of 100 ms at full scale: best %d, want 6360", scale, b.OK)
		}
	}
	cut := SteadyCut()
	cut.Deadline = 500 * ms // down from 3 s to 4.1 s: what starts before 3.6 s expires
	if b, _ := cut.Bound(); b.OK >= 7200-6*60 || b.OK < 7200-11*60 {
		t.Errorf("sticky cut, 500 ms deadlines: best %d, want 6 to 11 windows' calls lost", b.OK)
	}
}

func TestRecoveryAndGoodput(t *testing.T) {
	// completions every 50 ms in 250 ms buckets; trigger from 1 s to 2 s
	mk := func(fail func(end time.Duration) bool, until time.Duration) *Steady {
		s := &Steady{Bucket: 250 * ms, TriggerStart: time.Second, TriggerEnd: 2 * time.Second, Rate: 20}
		for end := time.Duration(0); end < until; end += 50 * ms {
			o := "ok"
			if fail(end) {
				o = "error Unavailable"
			}
			s.Calls = append(s.Calls, Completion{Start: end - 10*ms, End: end, Outcome: o})
		}
		return s
	}
	tests := []struct {
		name  string
		s     *Steady
		want  time.Duration
		never bool
	}{
		{"never failed", mk(func(time.Duration) bool { return false }, 3*time.Second), 0, false},
		{"failed during the trigger only", mk(func(e time.Duration) bool { return e >= time.Second && e < 2*time.Second }, 3*time.Second), 0, false},
		{"failed until 1.3 s after", mk(func(e time.Duration) bool { return e >= time.Second && e < 3300*ms }, 5*time.Second), 1500 * ms, false},
		{"one failure in 5 sinks a bucket", mk(func(e time.Duration) bool { return e == 2600*ms }, 4*time.Second), 750 * ms, false},
		{"still failing at the end", mk(func(e time.Duration) bool { return e >= time.Second }, 4*time.Second), 0, true},
		{"nothing completed", &Steady{Bucket: 250 * ms}, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, never := tt.s.Recovery(RecoveredShare)
			if d != tt.want || never != tt.never {
				t.Errorf("Recovery = %v, never %v; want %v, %v", d, never, tt.want, tt.never)
			}
		})
	}
	// 5 completions per bucket; a bucket with a failure counts 4 ok
	ok, all := tests[3].s.Goodput()
	if len(all) != 16 || all[0] != 5 || ok[10] != 4 || all[10] != 5 || ok[11] != 5 {
		t.Errorf("Goodput = %v, %v", ok, all)
	}
	if ok, all := (*Steady)(nil).Goodput(); ok != nil || all != nil {
		t.Error("a nil Steady has goodput")
	}
}

func TestSummarizeTakesMedians(t *testing.T) {
	run := func(ok int, attempts int64, lat []time.Duration, failUntil time.Duration) Result {
		s := &Steady{Bucket: 250 * ms, TriggerEnd: time.Second, Rate: 4}
		for end := time.Duration(0); end < 3*time.Second; end += 250 * ms {
			o := "ok"
			if end < failUntil {
				o = "exhausted"
			}
			s.Calls = append(s.Calls, Completion{End: end, Outcome: o})
		}
		return Result{Strategy: "x", Calls: 100, Succeeded: ok, Latencies: lat, Steady: s,
			Stats: &demov1.GetStatsResponse{Attempts: attempts, LastSuccessMs: attempts}}
	}
	lats := func(ds ...time.Duration) []time.Duration { return ds }
	got := Summarize(
		run(90, 150, lats(ms, 2*ms, 3*ms, 4*ms), 2*time.Second),
		run(70, 300, lats(5*ms, 6*ms, 7*ms, 8*ms), 4*time.Second), // never recovers
		run(80, 200, lats(9*ms, 10*ms, 11*ms, 12*ms), 1500*ms),
	)
	if got.Runs != 3 || got.OK != 80 || got.Attempts != 200 || got.AttemptsPerCall != 2 || got.LastSuccess != 200*ms ||
		got.Recovery != time.Second || got.Never || got.P50 != 6*ms || got.P99 != 8*ms || got.OKShare() != 80 {
		t.Errorf("Summarize = %+v", got)
	}
	if s := Summarize(run(1, 1, nil, 4*time.Second), run(1, 1, nil, 4*time.Second), run(1, 1, nil, 0)); !s.Never {
		t.Errorf("two of three runs never recovered: %+v", s)
	}
	if r := MedianRun([]Result{{Succeeded: 3}, {Succeeded: 1}, {Succeeded: 2}}); r.Succeeded != 2 {
		t.Errorf("MedianRun picked %d ok", r.Succeeded)
	}
}

func TestPercentileNearestRank(t *testing.T) {
	r := Result{Latencies: []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}
	for q, want := range map[float64]time.Duration{0: 1, 0.5: 5, 0.9: 9, 0.95: 10, 0.99: 10, 1: 10} {
		if got := r.Percentile(q); got != want {
			t.Errorf("Percentile(%v) = %v, want %v", q, got, want)
		}
	}
	if got := (Result{}).Percentile(0.5); got != 0 {
		t.Errorf("no latencies: %v", got)
	}
}

// TestSteadyRunOverGRPC runs a short steady load against a healthy server:
// every call starts on schedule, never early, and succeeds, and the server
// counts one first attempt per call.
func TestSteadyRunOverGRPC(t *testing.T) {
	_, addr := startServer(t, Faults{})
	sc := Scenario{Name: "steady", Rate: 500, Duration: 400 * ms, Deadline: time.Second, Bucket: 50 * ms}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := (&Runner{Addr: addr}).Run(ctx, sc, NoRetriesStrategy(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if res.Calls != 200 || res.Succeeded != 200 || len(res.Steady.Calls) != 200 || res.Stats.FirstAttempts != 200 || res.AttemptsPerCall() != 1 {
		t.Fatalf("%d calls, %d ok, %d recorded, server saw %d: want 200 of each", res.Calls, res.Succeeded, len(res.Steady.Calls), res.Stats.FirstAttempts)
	}
	for i, c := range res.Steady.Calls {
		if c.Start < time.Duration(i)*2*ms || c.End < c.Start || !c.OK() {
			t.Fatalf("call %d: %+v; it must start no earlier than %v and end ok", i, c, time.Duration(i)*2*ms)
		}
	}
	if d, never := res.Steady.Recovery(RecoveredShare); d != 0 || never {
		t.Errorf("recovery %v, never %v on a healthy server", d, never)
	}
	if len(res.Latencies) != 200 || res.Percentile(0.5) <= 0 {
		t.Errorf("%d latencies, p50 %v", len(res.Latencies), res.Percentile(0.5))
	}
}

// A closed loop keeps its callers busy until its duration has passed,
// counts every call, and keeps the latencies of the ok ones and of the
// failed ones; against a server that fails every attempt, a retrying
// strategy sends its attempts and every call fails.
func TestClosedLoopOverGRPC(t *testing.T) {
	_, addr := startServer(t, Faults{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		p      float64
		st     Strategy
		perOne float64 // attempts per call
	}{
		{0, NoRetriesStrategy(), 1},
		{1, PartialStrategies(ClosedPartial(1))[1], 3}, // retries alone, 3 attempts
	} {
		sc := ClosedPartial(tc.p)
		sc.Workers, sc.Duration = 2, 300*ms
		res, err := (&Runner{Addr: addr}).Run(ctx, sc, tc.st, 1)
		if err != nil {
			t.Fatal(err)
		}
		sum := 0
		for _, n := range res.Outcomes {
			sum += n
		}
		if res.Calls == 0 || sum != res.Calls || res.Succeeded+res.Failed != res.Calls || len(res.Latencies)+len(res.FailedLatencies) != res.Calls ||
			res.Elapsed < sc.Duration || res.AttemptsPerCall() != tc.perOne {
			t.Errorf("p = %g, %s: %d calls (outcomes %v), %d ok, %d failed, %d and %d latencies, %v, %.2f attempts a call; want them to add up, over %v, %v a call",
				tc.p, tc.st.Name, res.Calls, res.Outcomes, res.Succeeded, res.Failed, len(res.Latencies), len(res.FailedLatencies), res.Elapsed, res.AttemptsPerCall(), sc.Duration, tc.perOne)
		}
		if (tc.p == 0) != (res.Failed == 0) || (tc.p == 1) != (res.Succeeded == 0) {
			t.Errorf("p = %g: %d ok, %d failed", tc.p, res.Succeeded, res.Failed)
		}
	}
}

// Every name ScenarioNames lists stands for scenarios; an unknown one for
// none.
func TestScenariosNamed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		first string
		n     int
	}{
		{"published", Published().Name, 1},
		{"all", Published().Name, 4},
		{"herd-80", Herd(80).Name, 1},
		{"herds", Herd(20).Name, 3},
		{"steady-gentle", SteadyGentle().Name, 1},
		{"steady", SteadyCut().Name, 3},
		{"herds-deadline", HerdDeadline(20).Name, 3},
		{"partial-open", Partial(0.3).Name, len(PartialShares)},
		{"partial-closed", ClosedPartial(0.3).Name, len(PartialShares)},
		{"partial-short", Partial(0.67).Name, 4},
		{"partial", Partial(0.3).Name, 2 * len(PartialShares)},
	} {
		scs, ok := ScenariosNamed(tc.name)
		if !ok || len(scs) != tc.n || scs[0].Name != tc.first {
			t.Errorf("ScenariosNamed(%q) = %d scenarios, first %q, %v; want %d, first %q", tc.name, len(scs), first(scs), ok, tc.n, tc.first)
		}
	}
	want := `"published", "overload", "lost-replies", "slow", "all", "herd-20", "herd-80", "herd-320", "herds", "steady-cut", "steady-outage", "steady-gentle", "steady", "herds-deadline", "partial-open", "partial-closed", "partial-short", "partial", "dead-refusing", "dead-killed", "dead-refusing-nodeadline", "dead-killed-nodeadline" or "dead"`
	if got := ScenarioNames(); got != want {
		t.Errorf("ScenarioNames() = %s\nwant %s", got, want)
	}
	if scs, ok := ScenariosNamed("herd-81"); ok || scs != nil {
		t.Errorf("ScenariosNamed(herd-81) = %v, %v; want none", scs, ok)
	}
}

func first(scs []Scenario) string {
	if len(scs) == 0 {
		return ""
	}
	return scs[0].Name
}
