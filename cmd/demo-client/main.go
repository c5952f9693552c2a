// Command demo-client reproduces the retry-storm experiment over real gRPC:
// it fires a herd of calls, or a steady load, at the demo server through
// herdguard configured as each strategy and prints what the server and the
// client counted.
//
//	demo-client -addr 127.0.0.1:7000 -compare -scale 5 -svg storm.svg
//	demo-client -addr 127.0.0.1:7000 -compare -scenario herds,steady -runs 3 -goodput-svg goodput.svg
//	demo-client -addr 127.0.0.1:7000 -strategy "exponential + full jitter" -trace
//	demo-client -addr 127.0.0.1:7000 -otlp 127.0.0.1:4317 -jaeger http://127.0.0.1:16686 -trace-svg call.svg
//	demo-client -mesh -server-bin bin/demo-server -ggm-tier-bin bin/ggm-tier -scale 2 -runs 3 -mesh-svg mesh.svg
//
// With -mesh it runs the mesh lab instead: a chain of demo-server
// processes on 127.0.0.1, user client -> gateway -> service -> leaf, started
// afresh for every run of every mesh strategy, and reports the attempts the
// leaf received per user call at a healthy leaf and through the leaf's
// brownouts (-scenario healthy, steady-cut, steady-outage, brownouts,
// partial-0.67, all, or trace; -mesh-strategies picks strategies). -addr
// is not needed: the lab starts the leaf too.
// With -otlp, every process of the chain exports its spans there too (as
// services gateway, service and leaf), the trace context carried down every
// hop; with -jaeger, -trace and -trace-svg then read user calls back from
// Jaeger and print and draw one whose retries happened below the user
// (-scenario trace: a short run at a 67 % failing leaf, made for this).
//
// With -trace or -otlp, every call is traced: herdguard's call, attempt and
// backoff spans, otelgrpc's client span under each attempt, and the W3C
// trace context sent to the server, so a traced demo-server's spans join
// the same trace. Spans are exported as service "demo-client"
// (OTEL_SERVICE_NAME overrides it), and every call span names the scenario
// and strategy it ran in (stormlab.scenario, stormlab.strategy).
//
// -scale divides every duration (waits, windows, outages, deadlines) and
// multiplies a steady load's rate, so a comparison fits in about a minute;
// -scale 1 reproduces the published times. The herds (herd-20, herd-80,
// herd-320) and the brownouts under steady load (steady-cut, steady-outage,
// steady-gentle) are those of docs/stormlab.md; -runs N runs each strategy
// N times and prints the medians.
package main

import (
	"context"
	"encoding/csv"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

type options struct {
	addr, strategy, scenario, svg, otlp string
	traceSVG, jaeger, goodputSVG        string
	partialSVG, fleetSVG, clients       string
	mesh                                bool
	serverBin, ggmTierBin, meshSVG      string
	meshStrategies                      string
	calls, attempts, samples, width     int
	runs                                int
	base                                time.Duration
	scale                               float64
	compare, trace                      bool
	windowsCSV                          string
	windows                             *csv.Writer // set by run from windowsCSV
	callsCSV                            string
	callRows                            *csv.Writer // set by run from callsCSV
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("demo-client: ")
	var o options
	flag.StringVar(&o.addr, "addr", "", "the demo server, host:port on loopback (required)")
	flag.BoolVar(&o.compare, "compare", false, "run every strategy, one after another, and print one table")
	flag.StringVar(&o.strategy, "strategy", "herdguard defaults", "the strategies to run without -compare, separated by commas: "+strategyNames())
	flag.StringVar(&o.scenario, "scenario", "", "the scenarios, separated by commas: "+stormlab.ScenarioNames()+" (default: all with -compare, else published)")
	flag.IntVar(&o.calls, "calls", 1000, "calls fired at the same instant (herds; not steady load)")
	flag.IntVar(&o.attempts, "attempts", 5, "attempts per call, the first included (herds; steady load has policy.Default's 3)")
	flag.DurationVar(&o.base, "base", time.Second, "the first wait, at full scale (herds; steady load has policy.Default's 100ms)")
	flag.IntVar(&o.runs, "runs", 1, "run each strategy of the herd-*, steady-* and partial-* scenarios this many times and print the medians")
	flag.StringVar(&o.goodputSVG, "goodput-svg", "", "write the steady loads' goodput over time to this SVG file")
	flag.StringVar(&o.partialSVG, "partial-svg", "", "write the partial failures' calls ok against p to this SVG file")
	flag.StringVar(&o.clients, "clients", "1", "run each herd and brownout offered by each of these numbers of clients (separated by commas), each with a connection and an interceptor of its own, the calls dealt out in turn")
	flag.StringVar(&o.windowsCSV, "windows-csv", "", "write the server's counts per window (first attempts, retries, failed, succeeded) of every herd and brownout run to this CSV file")
	flag.StringVar(&o.callsCSV, "calls-csv", "", "write every call of every brownout run (start and end in ms since the run's first call, outcome) to this CSV file")
	flag.StringVar(&o.fleetSVG, "fleet-svg", "", "write the herds' and brownouts' calls ok against the number of clients to this SVG file")
	flag.Float64Var(&o.scale, "scale", 1, "divide every duration by this (1 reproduces the published times)")
	flag.StringVar(&o.svg, "svg", "", "also write the histograms to this SVG file")
	flag.BoolVar(&o.trace, "trace", false, "print the span tree of a sample of retried calls")
	flag.IntVar(&o.samples, "trace-samples", 1, "how many calls per strategy -trace prints")
	flag.StringVar(&o.otlp, "otlp", "", "export spans over OTLP gRPC to this collector on loopback (host:port)")
	flag.StringVar(&o.traceSVG, "trace-svg", "", "draw one retried call as a waterfall of its spans into this SVG file")
	flag.StringVar(&o.jaeger, "jaeger", "", "with -otlp and -trace-svg: the Jaeger query service (http://host:port) to read the drawn call back from, with the server's spans")
	flag.IntVar(&o.width, "width", 72, "columns of the terminal histograms")
	flag.BoolVar(&o.mesh, "mesh", false, "run the mesh lab: a chain of demo-server processes, user -> gateway -> service -> leaf (needs -server-bin)")
	flag.StringVar(&o.serverBin, "server-bin", "", "-mesh: the demo-server binary the leaf and the tiers run in")
	flag.StringVar(&o.ggmTierBin, "ggm-tier-bin", "", "-mesh: the ggm-tier binary (module bench) for \""+stormlab.MeshGGM+"\"; without it that strategy is left out")
	flag.StringVar(&o.meshSVG, "mesh-svg", "", "-mesh: write the leaf's attempts per user call over time to this SVG file")
	flag.StringVar(&o.meshStrategies, "mesh-strategies", "", "-mesh: the mesh strategies, separated by commas (default: all): "+stormlab.MeshStrategyNames())
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o, os.Stdout, os.Stderr); err != nil {
		log.Fatal(err)
	}
}

func strategyNames() string {
	var names []string
	all := append(stormlab.StrategiesFor(stormlab.Overload()), stormlab.StrategiesFor(stormlab.LostReplies())...)
	all = append(append(all, stormlab.HedgingStrategies()...), stormlab.HerdStrategies(stormlab.Herd(80))...)
	for _, s := range append(all, stormlab.SteadyStrategies()...) {
		if q := fmt.Sprintf("%q", s.Name); !slices.Contains(names, q) {
			names = append(names, q)
		}
	}
	return strings.Join(names, ", ")
}

func run(ctx context.Context, o options, out, progress io.Writer) error {
	if o.mesh {
		return runMesh(ctx, o, out, progress)
	}
	if err := checkLoopback("-addr", o.addr); err != nil {
		return err
	}
	if o.runs == 0 {
		o.runs = 1
	}
	if o.scale <= 0 || o.calls <= 0 || o.attempts <= 0 || o.base <= 0 || o.runs < 0 {
		return fmt.Errorf("-scale %v, -calls %d, -attempts %d, -base %v and -runs %d must all be positive", o.scale, o.calls, o.attempts, o.base, o.runs)
	}
	scenarios, err := pickScenarios(o)
	if err != nil {
		return err
	}
	fleets, err := parseClients(o.clients)
	if err != nil {
		return err
	}

	for _, c := range []struct {
		path   string
		header []string
		w      **csv.Writer
	}{{o.windowsCSV, stormlab.WindowsHeader, &o.windows}, {o.callsCSV, stormlab.CallsHeader, &o.callRows}} {
		if c.path == "" {
			continue
		}
		f, err := os.Create(c.path)
		if err != nil {
			return err
		}
		defer f.Close()
		*c.w = csv.NewWriter(f)
		if err := (*c.w).Write(c.header); err != nil {
			return err
		}
	}

	runner := &stormlab.Runner{Addr: o.addr}
	tr, err := newTracing(ctx, o)
	if err != nil {
		return err
	}
	defer tr.shutdown()
	if tr.tp != nil {
		runner.TracerProvider = tr.tp
		runner.DialOptions = []grpc.DialOption{stormlab.ClientTracing(tr.tp)}
	}

	total, n := 0, 0
	for _, sc := range scenarios {
		k := len(sc.strategies) * runsOf(sc.scenario, o)
		if sc.scenario.IsHerd() || sc.scenario.IsSteady() {
			k *= len(fleets)
		}
		total += k
	}
	began := time.Now()
	tty := isTerminal(progress)
	runner.OnProgress = func(scenario, strategy string, done bool) {
		if !done {
			tr.labeler.Set(scenario, strategy)
		}
		switch {
		case done:
			n++
			if tty {
				fmt.Fprintf(progress, "\r\033[K")
			}
		case tty:
			fmt.Fprintf(progress, "\r\033[K[%d/%d %4.0fs] %s: %s ...", n+1, total, time.Since(began).Seconds(), scenario, strategy)
		default:
			fmt.Fprintf(progress, "[%d/%d %4.0fs] %s: %s\n", n+1, total, time.Since(began).Seconds(), scenario, strategy)
		}
	}

	var svgSections, goodputSections []stormlab.SVGSection
	var partial partialRows
	var fleetPanels []stormlab.FleetPanel
	for _, sc := range scenarios {
		scaled := sc.scenario.Scale(o.scale)
		if scaled.IsPartial() {
			if err := partial.run(ctx, runner, sc, o); err != nil {
				return err
			}
			continue
		}
		if scaled.IsDead() {
			if err := runDead(ctx, runner, sc, o, out); err != nil {
				return err
			}
			continue
		}
		if scaled.IsHerd() || scaled.IsSteady() {
			panel := stormlab.FleetPanel{Title: sc.scenario.Name}
			for _, n := range fleets {
				runner.Clients = n
				section, rows, err := runCompared(ctx, runner, sc, n, o, out)
				if err != nil {
					return err
				}
				if n == fleets[0] {
					if scaled.IsSteady() {
						goodputSections = append(goodputSections, section)
					} else {
						svgSections = append(svgSections, section)
					}
				}
				for i, r := range rows {
					panel.Add(sc.strategies[i].Name, n, r.OKShare())
				}
			}
			runner.Clients = 1
			fleetPanels = append(fleetPanels, panel)
			continue
		}
		if scaled.Interval > 0 {
			f := scaled.Faults
			fmt.Fprintf(out, "\n== %s: %d calls, one every %v; attempts take %v to %v, 1 in %.0f takes %v (scale 1/%g) ==\n\n",
				sc.scenario.Name, scaled.Calls, scaled.Interval, f.Latency, f.Latency+f.LatencySpread, 1/f.SlowRate, f.SlowLatency, o.scale)
		} else {
			fmt.Fprintf(out, "\n== %s: %d calls at once, at most %d attempts, first wait %v, windows of %v (scale 1/%g) ==\n\n",
				sc.scenario.Name, scaled.Calls, scaled.Attempts, scaled.Base, scaled.Faults.Window, o.scale)
		}
		var results []stormlab.Result
		for _, st := range sc.strategies {
			if tr.rec != nil {
				tr.rec.Reset()
			}
			r, err := runner.Run(ctx, sc.scenario, st, o.scale)
			if err != nil {
				return err
			}
			results = append(results, r)
			if tr.rec != nil {
				tr.sample(out, st.Name, o)
			}
		}
		if err := stormlab.WriteTable(out, results); err != nil {
			return err
		}
		fmt.Fprintln(out)
		if err := stormlab.WriteOutcomes(out, results); err != nil {
			return err
		}
		fmt.Fprintln(out)
		if err := stormlab.WriteHistograms(out, results, o.width); err != nil {
			return err
		}
		svgSections = append(svgSections, stormlab.SVGSection{Title: sc.scenario.Name + ": retries per window at the server", Results: results})
	}
	if err := partial.write(out, o); err != nil {
		return err
	}
	fmt.Fprintln(out)
	for _, l := range legends(scenarios) {
		fmt.Fprintln(out, l)
	}

	if err := tr.finish(ctx, out, o); err != nil {
		return err
	}

	if o.svg != "" {
		if err := writeFile(o.svg, func(w io.Writer) error { return stormlab.WriteSVG(w, svgSections) }); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.svg)
	}
	if o.goodputSVG != "" {
		if err := writeFile(o.goodputSVG, func(w io.Writer) error { return stormlab.WriteGoodputSVG(w, goodputSections) }); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.goodputSVG)
	}
	if o.fleetSVG != "" && len(fleetPanels) > 0 {
		if err := writeFile(o.fleetSVG, func(w io.Writer) error { return stormlab.WriteFleetSVG(w, fleetPanels) }); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.fleetSVG)
	}
	if o.partialSVG != "" && (len(partial.open) > 0 || len(partial.closed) > 0) {
		if err := writeFile(o.partialSVG, func(w io.Writer) error { return stormlab.WritePartialSVG(w, partial.open, partial.closed) }); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.partialSVG)
	}
	return nil
}

// partialRows gathers the partial failures' rows, one per strategy, for
// each loop: their scenarios print one table per loop, at the end.
type partialRows struct {
	open, closed []stormlab.PartialRow
	openSC       []stormlab.Scenario // the scenarios run, scaled, in order
	closedSC     []stormlab.Scenario
}

// run runs every strategy of the partial failure sc o.runs times, in turn,
// and adds each strategy's cell to its row.
func (p *partialRows) run(ctx context.Context, runner *stormlab.Runner, sc plannedScenario, o options) error {
	rows, scs := &p.open, &p.openSC
	if sc.scenario.IsClosedLoop() {
		rows, scs = &p.closed, &p.closedSC
	}
	*scs = append(*scs, sc.scenario.Scale(o.scale))
	results := make([][]stormlab.Result, len(sc.strategies))
	for range o.runs { // in turn, so that a slow spell of the machine hits every strategy
		for i, st := range sc.strategies {
			r, err := runner.Run(ctx, sc.scenario, st, o.scale)
			if err != nil {
				return err
			}
			results[i] = append(results[i], r)
		}
	}
	for i, st := range sc.strategies {
		cell := stormlab.SummarizePartial(sc.scenario, o.scale, results[i]...)
		j := slices.IndexFunc(*rows, func(r stormlab.PartialRow) bool { return r.Strategy == st.Name })
		if j < 0 {
			*rows = append(*rows, stormlab.PartialRow{Strategy: st.Name})
			j = len(*rows) - 1
		}
		(*rows)[j].Cells = append((*rows)[j].Cells, cell)
	}
	return nil
}

// write prints the table of each loop that ran.
func (p *partialRows) write(out io.Writer, o options) error {
	for _, l := range []struct {
		rows   []stormlab.PartialRow
		scs    []stormlab.Scenario
		closed bool
	}{{p.open, p.openSC, false}, {p.closed, p.closedSC, true}} {
		if len(l.rows) == 0 {
			continue
		}
		sc := l.scs[0]
		load := fmt.Sprintf("%.0f calls/s for %v", sc.Rate, sc.Duration)
		if l.closed {
			load = fmt.Sprintf("%d callers in a closed loop for %v", sc.Workers, sc.Duration)
		}
		fmt.Fprintf(out, "\n== partial failures, %s, deadline %v, %d attempts, waits from %v to %v; the server fails each attempt with probability p (scale 1/%g%s) ==\n\n",
			load, sc.Deadline, sc.Attempts, sc.Base, sc.Cap, o.scale, medians(o.runs))
		if err := stormlab.WritePartialTable(out, l.closed, l.rows); err != nil {
			return err
		}
	}
	return nil
}

func medians(runs int) string {
	if runs <= 1 {
		return ""
	}
	return fmt.Sprintf("; medians of %d runs", runs)
}

// parseClients parses -clients: numbers of clients, at least 1 each; ""
// is one client.
func parseClients(s string) ([]int, error) {
	if s == "" {
		return []int{1}, nil
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(f), &n); err != nil || n < 1 {
			return nil, fmt.Errorf("-clients %q: want numbers of at least 1, separated by commas", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// runDead runs every strategy of a dead server o.runs times, in turn, and
// prints the table of medians and the outcomes of each strategy's median
// run.
func runDead(ctx context.Context, runner *stormlab.Runner, sc plannedScenario, o options, out io.Writer) error {
	scaled := sc.scenario.Scale(o.scale)
	deadline := fmt.Sprintf("deadline %v", scaled.Deadline)
	if scaled.Deadline <= 0 {
		deadline = "no deadline"
	}
	how := "refuses every attempt"
	if scaled.Faults.TriggerKill {
		how = "is killed (nothing listens on its address)"
	}
	fmt.Fprintf(out, "\n== %s: %.0f calls/s for %v, %s; the server answers, then from %v %s for %v, then answers again (scale 1/%g) ==\n\n",
		sc.scenario.Name, scaled.Rate, scaled.Duration, deadline, scaled.Faults.TriggerAt, how, scaled.Faults.TriggerFor, o.scale)
	results := make([][]stormlab.Result, len(sc.strategies))
	for range o.runs {
		for i, st := range sc.strategies {
			r, err := runner.Run(ctx, sc.scenario, st, o.scale)
			if err != nil {
				return err
			}
			results[i] = append(results[i], r)
		}
	}
	var rows []stormlab.DeadSummary
	var typical []stormlab.Result
	for i := range sc.strategies {
		rows = append(rows, stormlab.SummarizeDead(sc.scenario, o.scale, results[i]...))
		typical = append(typical, stormlab.MedianRun(results[i]))
	}
	if err := stormlab.WriteDeadTable(out, rows); err != nil {
		return err
	}
	fmt.Fprintln(out)
	if err := stormlab.WriteOutcomes(out, typical); err != nil {
		return err
	}
	fmt.Fprintln(out)
	return stormlab.WriteGoodput(out, typical, o.width)
}

// runsOf is how many times each strategy of sc runs: -runs for the herds,
// steady loads, partial failures and dead servers, once for the others.
func runsOf(sc stormlab.Scenario, o options) int {
	if sc.IsHerd() || sc.IsSteady() || sc.IsPartial() || sc.IsDead() {
		return o.runs
	}
	return 1
}

// runCompared runs every strategy of a herd or a steady load o.runs times,
// offered by the runner's clients (n of them), and prints the table of
// medians, each strategy's outcomes and a chart of its median run. It
// returns the chart's SVG section and the table's rows, in the strategies'
// order.
func runCompared(ctx context.Context, runner *stormlab.Runner, sc plannedScenario, n int, o options, out io.Writer) (stormlab.SVGSection, []stormlab.Summary, error) {
	scaled := sc.scenario.Scale(o.scale)
	f := scaled.Faults
	offered := ""
	if n > 1 {
		offered = fmt.Sprintf(", offered by %d clients", n)
	}
	if scaled.IsSteady() {
		trigger := fmt.Sprintf("capacity %d per window", f.TriggerCapacity)
		if f.TriggerOutage {
			trigger = "a full outage"
		}
		fmt.Fprintf(out, "\n== %s: %.0f calls/s for %v%s, deadline %v; %s server, %d attempts per %v window; from %v, %s for %v (scale 1/%g) ==\n\n",
			sc.scenario.Name, scaled.Rate, scaled.Duration, offered, scaled.Deadline, f.Model, f.Capacity, f.CapacityWindow, f.TriggerAt, trigger, f.TriggerFor, o.scale)
	} else {
		fmt.Fprintf(out, "\n== %s: %d calls at once%s, at most %d attempts, first wait %v; sticky server, %d attempts per %v window, %v of calm to recover (scale 1/%g) ==\n\n",
			sc.scenario.Name, scaled.Calls, offered, scaled.Attempts, scaled.Base, f.Capacity, f.CapacityWindow, f.RecoverAfter, o.scale)
	}
	var rows []stormlab.Summary
	var typical []stormlab.Result
	for _, st := range sc.strategies {
		var runs []stormlab.Result
		for i := range o.runs {
			r, err := runner.Run(ctx, sc.scenario, st, o.scale)
			if err != nil {
				return stormlab.SVGSection{}, nil, err
			}
			if o.windows != nil {
				if err := stormlab.WriteWindows(o.windows, n, i+1, r); err != nil {
					return stormlab.SVGSection{}, nil, fmt.Errorf("-windows-csv: %w", err)
				}
			}
			if o.callRows != nil {
				if err := stormlab.WriteCalls(o.callRows, n, i+1, r); err != nil {
					return stormlab.SVGSection{}, nil, fmt.Errorf("-calls-csv: %w", err)
				}
			}
			runs = append(runs, r)
		}
		rows = append(rows, stormlab.Summarize(runs...))
		typical = append(typical, stormlab.MedianRun(runs))
	}
	b, _ := scaled.Bound()
	var err error
	if scaled.IsSteady() {
		err = stormlab.WriteSteadyTable(out, b, rows)
	} else {
		err = stormlab.WriteHerdTable(out, b, rows)
	}
	if err != nil {
		return stormlab.SVGSection{}, nil, err
	}
	fmt.Fprintln(out)
	label := "outcomes"
	if o.runs > 1 {
		label = "outcomes of the median run"
	}
	fmt.Fprintf(out, "%s:\n", label)
	if err := stormlab.WriteOutcomes(out, typical); err != nil {
		return stormlab.SVGSection{}, nil, err
	}
	fmt.Fprintln(out)
	if scaled.IsSteady() {
		err = stormlab.WriteGoodput(out, typical, o.width)
		return stormlab.SVGSection{Title: sc.scenario.Name + offered + ": ok calls over time", Results: typical}, rows, err
	}
	err = stormlab.WriteHistograms(out, typical, o.width)
	return stormlab.SVGSection{Title: sc.scenario.Name + offered + ": retries per window at the server", Results: typical}, rows, err
}

// legends returns the legends of the tables the scenarios print.
func legends(scenarios []plannedScenario) []string {
	var herd, steady, partial, dead, other bool
	for _, sc := range scenarios {
		switch {
		case sc.scenario.IsDead():
			dead = true
		case sc.scenario.IsHerd():
			herd = true
		case sc.scenario.IsSteady():
			steady = true
		case sc.scenario.IsPartial():
			partial = true
		default:
			other = true
		}
	}
	var out []string
	if other {
		out = append(out, stormlab.Legend)
	}
	if herd {
		out = append(out, stormlab.HerdLegend)
	}
	if steady {
		out = append(out, stormlab.SteadyLegend)
	}
	if partial {
		out = append(out, stormlab.PartialLegend)
	}
	if dead {
		out = append(out, stormlab.DeadLegend)
	}
	return out
}

// writeFile creates name and writes it with write.
func writeFile(name string, write func(io.Writer) error) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

type plannedScenario struct {
	scenario   stormlab.Scenario
	strategies []stormlab.Strategy
}

func pickScenarios(o options) ([]plannedScenario, error) {
	which := o.scenario
	if which == "" {
		which = "published"
		if o.compare {
			which = "all"
		}
	}
	var scs []stormlab.Scenario
	for _, name := range strings.Split(which, ",") {
		more, ok := stormlab.ScenariosNamed(strings.TrimSpace(name))
		if !ok {
			return nil, fmt.Errorf("-scenario %q: want %s, or several separated by commas", name, stormlab.ScenarioNames())
		}
		scs = append(scs, more...)
	}
	if o.runs > 1 {
		for _, sc := range scs {
			if !sc.IsHerd() && !sc.IsSteady() && !sc.IsPartial() && !sc.IsDead() {
				return nil, fmt.Errorf("-runs %d with -scenario %q: medians are for the herd-*, steady-*, partial-* and dead-* scenarios only", o.runs, which)
			}
		}
	}
	var out []plannedScenario
	for _, sc := range scs {
		if !sc.IsSteady() && !sc.IsPartial() && !sc.IsDead() {
			sc.Calls, sc.Attempts, sc.Base = o.calls, o.attempts, o.base
		}
		all := stormlab.StrategiesFor(sc)
		if o.compare {
			out = append(out, plannedScenario{sc, all})
			continue
		}
		var picked []stormlab.Strategy
		for _, name := range strings.Split(o.strategy, ",") {
			for _, st := range all {
				if strings.EqualFold(st.Name, strings.TrimSpace(name)) {
					picked = append(picked, st)
				}
			}
		}
		if len(picked) > 0 {
			out = append(out, plannedScenario{sc, picked})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-strategy %q with -scenario %q: want one of %s", o.strategy, which, strategyNames())
	}
	return out, nil
}

func checkLoopback(flagName, addr string) error {
	if err := stormlab.CheckLoopback(addr); err != nil {
		return fmt.Errorf("%s %w", flagName, err)
	}
	return nil
}

// isTerminal reports whether w is a terminal, where a progress line that
// rewrites itself makes sense.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
