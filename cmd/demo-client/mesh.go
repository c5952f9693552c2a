package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

// runMesh runs the mesh lab: every picked mesh strategy o.runs times in
// turn, in every picked scenario, a fresh chain of processes each time; it
// prints one table per scenario, checks through the brownouts that the
// server half holds the leaf to one retrying layer without costing calls
// (stormlab.MeshHarm), and draws o.meshSVG.
func runMesh(ctx context.Context, o options, out, progress io.Writer) error {
	if o.runs == 0 {
		o.runs = 1
	}
	if o.scale <= 0 || o.runs < 0 {
		return fmt.Errorf("-scale %v and -runs %d must be positive", o.scale, o.runs)
	}
	if o.serverBin == "" {
		return fmt.Errorf("-mesh needs -server-bin, the demo-server binary the leaf and the tiers run in")
	}
	which := o.scenario
	if which == "" {
		which = "all"
	}
	var scs []stormlab.Scenario
	for _, name := range strings.Split(which, ",") {
		more, ok := stormlab.MeshScenariosNamed(name)
		if !ok {
			return fmt.Errorf("-mesh -scenario %q: want %s, or several separated by commas", name, stormlab.MeshScenarioNames())
		}
		scs = append(scs, more...)
	}
	strategies, err := pickMeshStrategies(o, progress)
	if err != nil {
		return err
	}

	if (o.trace || o.traceSVG != "") && (o.otlp == "" || o.jaeger == "") {
		return fmt.Errorf("-mesh with -trace or -trace-svg reads the chain's spans back from Jaeger: it needs -otlp and -jaeger")
	}
	tr, err := newTracing(ctx, o)
	if err != nil {
		return err
	}
	defer tr.shutdown()

	lab := &stormlab.MeshLab{ServerBin: o.serverBin, Stderr: progress}
	if tr.tp != nil {
		lab.Tracing = func(string) trace.TracerProvider { return tr.tp }
		lab.OTLP = o.otlp
	}
	if o.ggmTierBin != "" {
		lab.TierBins = map[string]string{stormlab.GGMPeer: o.ggmTierBin}
	}
	total, n := len(scs)*len(strategies)*o.runs, 0
	began := time.Now()
	tty := isTerminal(progress)
	lab.OnProgress = func(scenario, strategy string, done bool) {
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
			fmt.Fprintf(progress, "\r\033[K[%d/%d %4.0fs] mesh, %s: %s ...", n+1, total, time.Since(began).Seconds(), scenario, strategy)
		default:
			fmt.Fprintf(progress, "[%d/%d %4.0fs] mesh, %s: %s\n", n+1, total, time.Since(began).Seconds(), scenario, strategy)
		}
	}

	var sections []stormlab.MeshSection
	var failed []string
	for _, sc := range scs {
		runs := make([][]stormlab.MeshResult, len(strategies))
		for range o.runs { // in turn, so that a slow spell of the machine hits every strategy
			for i, ms := range strategies {
				r, err := lab.Run(ctx, sc, ms, o.scale)
				if err != nil {
					return err
				}
				runs[i] = append(runs[i], r)
			}
		}
		rows := make([]stormlab.MeshSummary, len(strategies))
		for i := range strategies {
			rows[i] = stormlab.SummarizeMesh(runs[i]...)
		}
		scaled := sc.Scale(o.scale)
		f := scaled.Faults
		leaf := fmt.Sprintf("the leaf fails %.0f %% of attempts on its own", 100*f.FailRate)
		if f.TriggerFor > 0 {
			trigger := fmt.Sprintf("capacity %d per window", f.TriggerCapacity)
			if f.TriggerOutage {
				trigger = "a full outage"
			}
			leaf = fmt.Sprintf("%s leaf, %d attempts per %v window; from %v, %s for %v", f.Model, f.Capacity, f.CapacityWindow, f.TriggerAt, trigger, f.TriggerFor)
		}
		fmt.Fprintf(out, "\n== mesh, depth %d: %s: %.0f calls/s for %v at the gateway, deadline %v; %s (scale 1/%g) ==\n\n",
			stormlab.MeshDepth, sc.Name, scaled.Rate, scaled.Duration, scaled.Deadline, leaf, o.scale)
		if err := stormlab.WriteMeshTable(out, sc, rows); err != nil {
			return err
		}
		fmt.Fprintln(out)
		typical := make([]stormlab.Result, len(rows))
		for i, r := range rows {
			typical[i] = r.Typical.Result
		}
		label := "outcomes at the user"
		if o.runs > 1 {
			label += ", of the median run"
		}
		fmt.Fprintf(out, "%s:\n", label)
		if err := stormlab.WriteOutcomes(out, typical); err != nil {
			return err
		}
		if sc.IsSteady() {
			if _, ok := stormlab.MeshRow(rows, stormlab.MeshServerHalf); ok {
				if _, ok := stormlab.MeshRow(rows, stormlab.MeshLastHop); ok {
					errs := stormlab.MeshHarm(rows)
					for _, err := range errs {
						failed = append(failed, fmt.Sprintf("%s: %v", sc.Name, err))
					}
					if len(errs) == 0 {
						every := ""
						if _, ok := stormlab.MeshRow(rows, stormlab.MeshHerdguard); ok {
							every = ", and no fewer than herdguard at every layer's"
						}
						fmt.Fprintf(out, "checked: the server half keeps the leaf's attempts per user call within 1.1 x the last hop only's, and its calls ok within 1 point of the last hop only's%s\n", every)
					}
				}
			}
		}
		if sc.Name == stormlab.MeshHealthy().Name {
			errs := stormlab.MeshHealthyCheck(rows)
			for _, err := range errs {
				failed = append(failed, fmt.Sprintf("%s: %v", sc.Name, err))
			}
			if len(errs) == 0 {
				fmt.Fprintf(out, "checked: at a healthy leaf the server half adds no attempt (one per user call, every call ok) and no latency the lab can see (p50 within %v of herdguard at every layer's)\n", stormlab.MeshLatencyResolution)
			}
		}
		sections = append(sections, stormlab.MeshSection{Title: sc.Name + ": the leaf's attempts per user call", Rows: rows})
	}
	if tr.rec != nil {
		if err := tr.meshSample(ctx, out, o); err != nil {
			return err
		}
	} else if tr.tp != nil {
		if err := tr.finish(ctx, out, o); err != nil {
			return err
		}
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, stormlab.MeshLegend)
	for _, f := range failed {
		fmt.Fprintf(out, "check failed: %s\n", f)
	}
	if o.meshSVG != "" {
		if err := writeFile(o.meshSVG, func(w io.Writer) error { return stormlab.WriteMeshSVG(w, sections) }); err != nil {
			return err
		}
		fmt.Fprintf(out, "wrote %s\n", o.meshSVG)
	}
	return nil
}

// pickMeshStrategies returns the mesh strategies -mesh-strategies names
// (all by default), less go-grpc-middleware's without -ggm-tier-bin, which
// it says on progress when it was not asked for by name.
func pickMeshStrategies(o options, progress io.Writer) ([]stormlab.MeshStrategy, error) {
	if o.meshStrategies == "" {
		var out []stormlab.MeshStrategy
		for _, ms := range stormlab.MeshStrategies() {
			if ms.External == stormlab.GGMPeer && o.ggmTierBin == "" {
				fmt.Fprintf(progress, "demo-client: no -ggm-tier-bin: leaving out %q\n", ms.Name)
				continue
			}
			out = append(out, ms)
		}
		return out, nil
	}
	var out []stormlab.MeshStrategy
	for _, name := range strings.Split(o.meshStrategies, ",") {
		ms, ok := stormlab.MeshStrategyNamed(name)
		if !ok {
			return nil, fmt.Errorf("-mesh-strategies %q: want some of %s", name, stormlab.MeshStrategyNames())
		}
		if ms.External == stormlab.GGMPeer && o.ggmTierBin == "" {
			return nil, fmt.Errorf("-mesh-strategies %q needs -ggm-tier-bin (make ggm-tier builds it into bin/)", ms.Name)
		}
		out = append(out, ms)
	}
	return out, nil
}
