package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/failsafe-go/failsafe-go/failsafegrpc"
	"github.com/failsafe-go/failsafe-go/hedgepolicy"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/cmd/stormlab"
	"github.com/herdguard/herdguard/internal/testserver"
)

// defaultStormScale shortens the storm comparison: windows of 50 ms, the
// steady loads at 1200 calls/s for 6 s. One run per peer and scenario keeps
// the whole table to about 6 minutes; make storm has the medians at full
// scale. HERDGUARD_STORM_SCALE=1 runs the peers at full scale too (about
// 12 minutes).
const defaultStormScale = 2

// stormScale is HERDGUARD_STORM_SCALE, or defaultStormScale.
func stormScale(t *testing.T) float64 {
	v := os.Getenv("HERDGUARD_STORM_SCALE")
	if v == "" {
		return defaultStormScale
	}
	s, err := strconv.ParseFloat(v, 64)
	if err != nil || s < 1 {
		t.Fatalf("HERDGUARD_STORM_SCALE=%q: want a number of at least 1", v)
	}
	return s
}

// stormRuns is HERDGUARD_STORM_RUNS: how many runs of each peer and
// scenario the storm table takes the medians of; 1 without it.
func stormRuns(t *testing.T) int {
	v := os.Getenv("HERDGUARD_STORM_RUNS")
	if v == "" {
		return 1
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("HERDGUARD_STORM_RUNS=%q: want a whole number of at least 1", v)
	}
	return n
}

// stormClients is HERDGUARD_STORM_CLIENTS: the numbers of clients
// (separated by commas) the herds and brownouts are offered by, each
// client with a connection of its own (and herdguard's strategies an
// interceptor of their own); 1 without it. The partial failures run
// with one client.
func stormClients(t *testing.T) []int {
	v := os.Getenv("HERDGUARD_STORM_CLIENTS")
	if v == "" {
		return []int{1}
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			t.Fatalf("HERDGUARD_STORM_CLIENTS=%q: want whole numbers of at least 1, separated by commas", v)
		}
		out = append(out, n)
	}
	return out
}

// stormScenarios are the scenarios HERDGUARD_STORM_SCENARIOS names
// (separated by commas, as the demo client's -scenario names them:
// herd-80, steady-gentle, herds, steady, partial), or every herd and
// brownout and the short form of the partial failures without it.
func stormScenarios(t *testing.T) []stormlab.Scenario {
	v := os.Getenv("HERDGUARD_STORM_SCENARIOS")
	if v == "" {
		return append(append(stormlab.Herds(), stormlab.SteadyScenarios()...), stormlab.PartialShort()...)
	}
	var out []stormlab.Scenario
	for _, name := range strings.Split(v, ",") {
		scs, ok := stormlab.ScenariosNamed(strings.TrimSpace(name))
		if !ok {
			t.Fatalf("HERDGUARD_STORM_SCENARIOS names %q: want some of %s", name, stormlab.ScenarioNames())
		}
		out = append(out, scs...)
	}
	return out
}

// stormPeer is one client in the storm table: herdguard configured as a
// stormlab strategy, or another library installed by its dial options.
type stormPeer struct {
	name     string
	strategy *stormlab.Strategy
	dial     func(sc stormlab.Scenario) []grpc.DialOption // sc is scaled
}

// stormPeers are the clients compared: no retries and herdguard's defaults
// (the herd's policy, or policy.Default under steady load, with the default
// breaker), go-grpc-middleware's retry, gRPC's built-in retry with gRFC A6's
// throttling and failsafe-go's retry policy, each with the scenario's
// attempts and first wait.
func stormPeers(t *testing.T, sc stormlab.Scenario) []stormPeer {
	if sc.IsPartial() {
		return partialPeers(t, sc)
	}
	none := stormlab.NoRetriesStrategy()
	defaults := stormlab.Strategies(sc)[len(stormlab.Strategies(sc))-1]
	if sc.IsSteady() {
		defaults = stormlab.SteadyStrategies()[1]
	}
	return []stormPeer{
		{name: none.Name, strategy: &none},
		{name: defaults.Name, strategy: &defaults},
		{name: "go-grpc-middleware retry", dial: func(sc stormlab.Scenario) []grpc.DialOption {
			return []grpc.DialOption{grpc.WithChainUnaryInterceptor(ggmRetry(t, sc.Attempts, sc.Base))}
		}},
		{name: "gRPC built-in retry + throttling", dial: func(sc stormlab.Scenario) []grpc.DialOption {
			return []grpc.DialOption{grpc.WithDefaultServiceConfig(stormlab.GRPCRetryConfig(sc.Attempts, sc.Base, time.Minute, true))}
		}},
		{name: "failsafe-go retry", dial: func(sc stormlab.Scenario) []grpc.DialOption {
			rp := failsafegrpc.NewRetryPolicyBuilder[any]().WithMaxAttempts(sc.Attempts).
				WithBackoff(sc.Base, time.Minute).WithJitterFactor(0.1).Build()
			// failsafe-go sends no attempt number: retryNumbers gives its
			// retries one, so that the server counts them as retries.
			return []grpc.DialOption{grpc.WithChainUnaryInterceptor(retryNumbers(failsafegrpc.NewUnaryClientInterceptor[any](rp)))}
		}},
	}
}

// partialPeers are the clients compared in a partial failure: the storm
// lab's own (no retries, retries alone, herdguard's defaults and each of
// its protections alone, gRPC's built-in retry), then go-grpc-middleware's
// retry and failsafe-go's retry policy with the scenario's attempts, first
// wait and longest wait.
func partialPeers(t *testing.T, sc stormlab.Scenario) []stormPeer {
	var out []stormPeer
	for _, st := range stormlab.PartialStrategies(sc) {
		out = append(out, stormPeer{name: st.Name, strategy: &st})
	}
	return append(out,
		stormPeer{name: "go-grpc-middleware retry", dial: func(sc stormlab.Scenario) []grpc.DialOption {
			return []grpc.DialOption{grpc.WithChainUnaryInterceptor(retry.UnaryClientInterceptor(retry.WithMax(uint(sc.Attempts)),
				retry.WithCodes(codes.Unavailable), retry.WithBackoff(retry.BackoffExponentialWithJitterBounded(sc.Base, 0.1, sc.Cap))))}
		}},
		stormPeer{name: "failsafe-go retry", dial: func(sc stormlab.Scenario) []grpc.DialOption {
			rp := failsafegrpc.NewRetryPolicyBuilder[any]().WithMaxAttempts(sc.Attempts).
				WithBackoff(sc.Base, sc.Cap).WithJitterFactor(0.1).Build()
			return []grpc.DialOption{grpc.WithChainUnaryInterceptor(retryNumbers(failsafegrpc.NewUnaryClientInterceptor[any](rp)))}
		}},
	)
}

// retryNumbers wraps a retrying interceptor that numbers no attempt: each
// attempt after a call's first carries "x-retry-attempt: n" (n = 1 for the
// first retry, as go-grpc-middleware numbers them), which the storm lab's
// server counts as a retry.
func retryNumbers(retrying grpc.UnaryClientInterceptor) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		n := new(atomic.Int32)
		return retrying(ctx, method, req, reply, cc, func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
			if a := n.Add(1); a > 1 {
				ctx = metadata.AppendToOutgoingContext(ctx, "x-retry-attempt", strconv.Itoa(int(a-1)))
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}, opts...)
	}
}

// TestStormTable drives the storm lab's herds (C = 20, 80, 320) and its
// three brownouts under steady load through no retries, herdguard's
// defaults, go-grpc-middleware's retry, gRPC's built-in retry with
// throttling and failsafe-go's retry policy, and prints the lab's tables;
// then the partial failures through partialPeers, one table per loop,
// which must show the defaults doing no harm (stormlab.PartialHarm), and,
// with HERDGUARD_PARTIAL_SVG set, their chart of calls ok against p.
// It runs only when HERDGUARD_STORM=1 (make bench sets it): it takes about
// 6 minutes. HERDGUARD_STORM_SCALE, HERDGUARD_STORM_RUNS and
// HERDGUARD_STORM_SCENARIOS change its scale, take medians of several runs
// and choose the scenarios: at full scale, the brownouts' medians of 3 take
// about 11 minutes.
func TestStormTable(t *testing.T) {
	if os.Getenv("HERDGUARD_STORM") != "1" {
		t.Skip("set HERDGUARD_STORM=1 to run the storm comparison")
	}
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	r := &stormlab.Runner{Addr: addr}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Hour)
	defer cancel()

	scale, runs := stormScale(t), stormRuns(t)
	if runs == 1 {
		fmt.Printf("Scale 1/%v, one run each.\n", scale)
	} else {
		fmt.Printf("Scale 1/%v, medians of %d runs each.\n", scale, runs)
	}
	var partialOpen, partialClosed []stormlab.PartialRow
	type offered struct {
		sc      stormlab.Scenario
		clients int
	}
	var plan []offered
	for _, n := range stormClients(t) {
		for _, sc := range stormScenarios(t) {
			if n == 1 || !sc.IsPartial() {
				plan = append(plan, offered{sc, n})
			}
		}
	}
	for _, o := range plan {
		sc := o.sc
		r.Clients = o.clients
		scaled := sc.Scale(scale)
		peers := stormPeers(t, sc)
		results := make([][]stormlab.Result, len(peers))
		for range runs { // in turn, so that a slow spell of the machine hits every peer
			for i, p := range peers {
				var res stormlab.Result
				if p.strategy != nil {
					res, err = r.Run(ctx, sc, *p.strategy, scale)
				} else {
					res, err = r.RunClient(ctx, scaled, p.name, p.dial(scaled), nil)
				}
				if err != nil {
					t.Fatalf("%s, %s: %v", sc.Name, p.name, err)
				}
				results[i] = append(results[i], res)
			}
		}
		if sc.IsPartial() {
			rows := &partialOpen
			if sc.IsClosedLoop() {
				rows = &partialClosed
			}
			for i, p := range peers {
				cell := stormlab.SummarizePartial(sc, scale, results[i]...)
				j := slices.IndexFunc(*rows, func(r stormlab.PartialRow) bool { return r.Strategy == p.name })
				if j < 0 {
					*rows = append(*rows, stormlab.PartialRow{Strategy: p.name})
					j = len(*rows) - 1
				}
				(*rows)[j].Cells = append((*rows)[j].Cells, cell)
			}
			continue
		}
		var rows []stormlab.Summary
		attempts := map[string]int64{}
		for i, p := range peers {
			rows = append(rows, stormlab.Summarize(results[i]...))
			attempts[p.name] = rows[i].Attempts
		}
		if o.clients > 1 {
			fmt.Printf("\n== %s, offered by %d clients ==\n\n", sc.Name, o.clients)
		} else {
			fmt.Printf("\n== %s ==\n\n", sc.Name)
		}
		b, _ := scaled.Bound()
		if sc.IsSteady() {
			err = stormlab.WriteSteadyTable(os.Stdout, b, rows)
		} else {
			err = stormlab.WriteHerdTable(os.Stdout, b, rows)
		}
		if err != nil {
			t.Fatal(err)
		}
		// What must hold: in the herd at C = 80, fewer attempts than the
		// peer that retries without a budget. The rest is reported, not
		// graded.
		if o.clients == 1 && sc.Name == stormlab.Herd(80).Name && attempts["herdguard defaults"] >= attempts["go-grpc-middleware retry"] {
			t.Errorf("%s: herdguard sent %d attempts, go-grpc-middleware %d: want fewer", sc.Name, attempts["herdguard defaults"], attempts["go-grpc-middleware retry"])
		}
	}
	for _, l := range []struct {
		name   string
		rows   []stormlab.PartialRow
		closed bool
	}{{"open loop", partialOpen, false}, {"closed loop", partialClosed, true}} {
		if len(l.rows) == 0 {
			continue
		}
		fmt.Printf("\n== partial failures, %s%s ==\n\n", l.name, mediansNote(runs))
		if err := stormlab.WritePartialTable(os.Stdout, l.closed, l.rows); err != nil {
			t.Fatal(err)
		}
		// What must hold: the defaults do no harm, and hold a
		// dead server back. The rest is reported, not graded.
		for _, err := range stormlab.PartialHarm(l.rows, l.closed) {
			t.Error(err)
		}
	}
	if out := os.Getenv("HERDGUARD_PARTIAL_SVG"); out != "" && len(partialOpen)+len(partialClosed) > 0 {
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := stormlab.WritePartialSVG(f, partialOpen, partialClosed); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		fmt.Printf("\nwrote %s\n", out)
	}
	fmt.Printf("\n%s\n\n%s\n\n%s\n", stormlab.HerdLegend, stormlab.SteadyLegend, stormlab.PartialLegend)
}

func mediansNote(runs int) string {
	if runs <= 1 {
		return ""
	}
	return fmt.Sprintf(", medians of %d runs", runs)
}

// hedgeRuns is how many times TestHedgeTable runs each strategy; it
// reports medians.
const hedgeRuns = 3

// TestHedgeTable drives the storm lab's slow attempts (1 in 100 takes 1 s)
// through herdguard without hedging, with a fixed hedging delay and with
// its latency-aware one, and through failsafe-go's hedge policy with the
// same fixed delay and with its own p95, hedgeRuns times each in turn, and
// prints one table of medians. It runs only when HERDGUARD_STORM=1 (make
// bench sets it): it takes about two minutes.
func TestHedgeTable(t *testing.T) {
	if os.Getenv("HERDGUARD_STORM") != "1" {
		t.Skip("set HERDGUARD_STORM=1 to run the hedging comparison")
	}
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	sc := stormlab.SlowAttempts()
	r := &stormlab.Runner{Addr: addr}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	type peer struct {
		name string
		dial func() []grpc.DialOption
	}
	var strategies []string
	runs := map[string][]stormlab.Result{}
	for range hedgeRuns {
		for _, st := range stormlab.HedgingStrategies() {
			res, err := r.Run(ctx, sc, st, 1)
			if err != nil {
				t.Fatal(err)
			}
			runs[st.Name] = append(runs[st.Name], res)
		}
		for _, p := range []peer{
			{"failsafe-go hedge, fixed 20ms", func() []grpc.DialOption {
				return []grpc.DialOption{grpc.WithChainUnaryInterceptor(failsafegrpc.NewUnaryClientInterceptor[any](hedgepolicy.NewWithDelay[any](20 * time.Millisecond)))}
			}},
			{"failsafe-go hedge at p95", func() []grpc.DialOption {
				// Its quantile over the last 256 latencies, known after 32, as herdguard's.
				return []grpc.DialOption{grpc.WithChainUnaryInterceptor(failsafegrpc.NewUnaryClientInterceptor[any](hedgepolicy.NewWithDelayQuantile[any](0.95, 256, 32)))}
			}},
		} {
			res, err := r.RunClient(ctx, sc, p.name, p.dial(), nil)
			if err != nil {
				t.Fatal(err)
			}
			runs[p.name] = append(runs[p.name], res)
		}
		if strategies == nil {
			for _, st := range stormlab.HedgingStrategies() {
				strategies = append(strategies, st.Name)
			}
			strategies = append(strategies, "failsafe-go hedge, fixed 20ms", "failsafe-go hedge at p95")
		}
	}

	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "strategy\tcalls\tcalls ok (fewest)\tp50\tp99\tp99.9\tmax\textra attempts\tp99.9 of each run\t\n")
	for _, name := range strategies {
		rs := runs[name]
		ok := rs[0].Succeeded
		var each []string
		for _, r := range rs {
			ok = min(ok, r.Succeeded)
			each = append(each, r.Percentile(0.999).Round(100*time.Microsecond).String())
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%v\t%v\t%v\t%v\t%.1f %%\t%s\t\n", name, rs[0].Calls, ok,
			medianLatency(rs, 0.5), medianLatency(rs, 0.99), medianLatency(rs, 0.999), medianLatency(rs, 1),
			100*medianExtra(rs), strings.Join(each, " "))
	}
	tw.Flush()
	fmt.Printf("\nMedians of %d runs of %d calls, one every %v; each attempt takes %v to %v, and 1 in %.0f takes %v.\n"+
		"p50 ... max: the latencies of the successful calls, timed by the client (nearest rank);\n"+
		"extra attempts: (attempts the server received - calls) / calls.\n",
		hedgeRuns, sc.Calls, sc.Interval, sc.Faults.Latency, sc.Faults.Latency+sc.Faults.LatencySpread, 1/sc.Faults.SlowRate, sc.Faults.SlowLatency)

	// What must hold: hedging at p95 cuts p99.9 at least
	// 20-fold for at most 5 % more attempts at the server, in the medians.
	none, p95 := runs["no hedging"], runs["hedging at p95"]
	if medianLatency(p95, 0.999)*20 > medianLatency(none, 0.999) || medianExtra(p95) > 0.05 {
		t.Errorf("hedging at p95: p99.9 %v against %v without hedging, %.1f %% more attempts; want 20 times lower for at most 5 %%",
			medianLatency(p95, 0.999), medianLatency(none, 0.999), 100*medianExtra(p95))
	}
}

// medianLatency is the median over runs of each run's q-quantile latency.
func medianLatency(rs []stormlab.Result, q float64) time.Duration {
	var v []time.Duration
	for _, r := range rs {
		v = append(v, r.Percentile(q))
	}
	slices.Sort(v)
	return v[len(v)/2].Round(100 * time.Microsecond)
}

// medianExtra is the median over runs of the extra attempts per call.
func medianExtra(rs []stormlab.Result) float64 {
	var v []float64
	for _, r := range rs {
		v = append(v, float64(r.Stats.GetAttempts()-int64(r.Calls))/float64(r.Calls))
	}
	slices.Sort(v)
	return v[len(v)/2]
}

// TestRetryNumbers: failsafe-go's retries, wrapped by retryNumbers, reach
// the server numbered as go-grpc-middleware numbers its own.
func TestRetryNumbers(t *testing.T) {
	var (
		mu   sync.Mutex
		seen []string
	)
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, strings.Join(md.Get("x-retry-attempt"), ","))
		if len(seen) < 3 {
			return nil, status.Error(codes.Unavailable, "down")
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	rp := failsafegrpc.NewRetryPolicyBuilder[any]().WithMaxAttempts(3).WithDelay(time.Millisecond).Build()
	c := srv.Client(t, grpc.WithChainUnaryInterceptor(retryNumbers(failsafegrpc.NewUnaryClientInterceptor[any](rp))))
	if _, err := c.UnaryCall(context.Background(), &testgrpc.SimpleRequest{}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, []string{"", "1", "2"}) {
		t.Errorf("attempt numbers seen by the server: %q, want none, 1, 2", seen)
	}
}
