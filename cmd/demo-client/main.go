// Command demo-client reproduces the retry-storm experiment over real gRPC:
// it fires a herd of calls at the demo server through herdguard configured
// as each strategy and prints what the server counted.
//
//	demo-client -addr 127.0.0.1:7000 -compare -scale 5 -svg storm.svg
//	demo-client -addr 127.0.0.1:7000 -strategy "exponential + full jitter" -trace
//	demo-client -addr 127.0.0.1:7000 -otlp 127.0.0.1:4317 -jaeger http://127.0.0.1:16686 -trace-svg call.svg
//
// With -trace or -otlp, every call is traced: herdguard's call, attempt and
// backoff spans, otelgrpc's client span under each attempt, and the W3C
// trace context sent to the server, so a traced demo-server's spans join
// the same trace. Spans are exported as service "demo-client"
// (OTEL_SERVICE_NAME overrides it), and every call span names the scenario
// and strategy it ran in (stormlab.scenario, stormlab.strategy).
//
// -scale divides every duration (waits, windows, outages) so a comparison
// fits in about a minute; -scale 1 reproduces the published times.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/internal/stormlab"
)

type options struct {
	addr, strategy, scenario, svg, otlp string
	traceSVG, jaeger                    string
	calls, attempts, samples, width     int
	base                                time.Duration
	scale                               float64
	compare, trace                      bool
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("demo-client: ")
	var o options
	flag.StringVar(&o.addr, "addr", "", "the demo server, host:port on loopback (required)")
	flag.BoolVar(&o.compare, "compare", false, "run every strategy, one after another, and print one table")
	flag.StringVar(&o.strategy, "strategy", "herdguard defaults", "the strategy to run without -compare: "+strategyNames())
	flag.StringVar(&o.scenario, "scenario", "", `"published", "overload", "lost-replies", "slow" or "all" (default: all with -compare, else published)`)
	flag.IntVar(&o.calls, "calls", 1000, "calls fired at the same instant")
	flag.IntVar(&o.attempts, "attempts", 5, "attempts per call, the first included")
	flag.DurationVar(&o.base, "base", time.Second, "the first wait, at full scale")
	flag.Float64Var(&o.scale, "scale", 1, "divide every duration by this (1 reproduces the published times)")
	flag.StringVar(&o.svg, "svg", "", "also write the histograms to this SVG file")
	flag.BoolVar(&o.trace, "trace", false, "print the span tree of a sample of retried calls")
	flag.IntVar(&o.samples, "trace-samples", 1, "how many calls per strategy -trace prints")
	flag.StringVar(&o.otlp, "otlp", "", "export spans over OTLP gRPC to this collector on loopback (host:port)")
	flag.StringVar(&o.traceSVG, "trace-svg", "", "draw one retried call as a waterfall of its spans into this SVG file")
	flag.StringVar(&o.jaeger, "jaeger", "", "with -otlp and -trace-svg: the Jaeger query service (http://host:port) to read the drawn call back from, with the server's spans")
	flag.IntVar(&o.width, "width", 72, "columns of the terminal histograms")
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
	for _, s := range append(all, stormlab.HedgingStrategies()...) {
		names = append(names, fmt.Sprintf("%q", s.Name))
	}
	return strings.Join(names, ", ")
}

func run(ctx context.Context, o options, out, progress io.Writer) error {
	if err := checkLoopback("-addr", o.addr); err != nil {
		return err
	}
	if o.scale <= 0 || o.calls <= 0 || o.attempts <= 0 || o.base <= 0 {
		return fmt.Errorf("-scale %v, -calls %d, -attempts %d and -base %v must all be positive", o.scale, o.calls, o.attempts, o.base)
	}
	scenarios, err := pickScenarios(o)
	if err != nil {
		return err
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
		total += len(sc.strategies)
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

	var svgSections []stormlab.SVGSection
	for _, sc := range scenarios {
		scaled := sc.scenario.Scale(o.scale)
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
	fmt.Fprintln(out)
	fmt.Fprintln(out, stormlab.Legend)

	if err := tr.finish(ctx, out, o); err != nil {
		return err
	}

	if o.svg != "" {
		f, err := os.Create(o.svg)
		if err != nil {
			return err
		}
		if err := stormlab.WriteSVG(f, svgSections); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.svg)
	}
	return nil
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
	switch which {
	case "published":
		scs = []stormlab.Scenario{stormlab.Published()}
	case "overload":
		scs = []stormlab.Scenario{stormlab.Overload()}
	case "lost-replies":
		scs = []stormlab.Scenario{stormlab.LostReplies()}
	case "slow":
		scs = []stormlab.Scenario{stormlab.SlowAttempts()}
	case "all":
		scs = []stormlab.Scenario{stormlab.Published(), stormlab.Overload(), stormlab.LostReplies(), stormlab.SlowAttempts()}
	default:
		return nil, fmt.Errorf(`-scenario %q: want "published", "overload", "lost-replies", "slow" or "all"`, which)
	}
	var out []plannedScenario
	for _, sc := range scs {
		sc.Calls, sc.Attempts, sc.Base = o.calls, o.attempts, o.base
		all := stormlab.StrategiesFor(sc)
		if o.compare {
			out = append(out, plannedScenario{sc, all})
			continue
		}
		var picked []stormlab.Strategy
		for _, st := range all {
			if strings.EqualFold(st.Name, o.strategy) {
				picked = append(picked, st)
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
