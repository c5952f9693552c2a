package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRejectsBadFlags(t *testing.T) {
	base := options{addr: "127.0.0.1:1", calls: 10, attempts: 3, base: time.Second, scale: 1, runs: 1, strategy: "herdguard defaults"}
	tests := []struct {
		name string
		edit func(*options)
		want string
	}{
		{"remote address", func(o *options) { o.addr = "10.1.2.3:80" }, "loopback"},
		{"no port", func(o *options) { o.addr = "127.0.0.1" }, "-addr"},
		{"zero scale", func(o *options) { o.scale = 0 }, "-scale"},
		{"unknown scenario", func(o *options) { o.scenario = "tsunami" }, `"tsunami"`},
		{"unknown strategy", func(o *options) { o.strategy = "pray" }, `"pray"`},
		{"remote collector", func(o *options) { o.otlp = "192.168.1.1:4317" }, "-otlp"},
		{"jaeger without otlp", func(o *options) { o.jaeger, o.traceSVG = "http://127.0.0.1:16686", "x.svg" }, "-jaeger"},
		{"jaeger not a URL", func(o *options) { o.jaeger, o.traceSVG, o.otlp = "127.0.0.1:16686", "x.svg", "127.0.0.1:1" }, "http://host:port"},
		{"remote jaeger", func(o *options) { o.jaeger, o.traceSVG, o.otlp = "http://10.0.0.1:16686", "x.svg", "127.0.0.1:1" }, "loopback"},
		{"negative runs", func(o *options) { o.runs = -1 }, "-runs -1"},
		{"medians of a scenario that has none", func(o *options) { o.runs, o.scenario = 3, "herds,published" }, "-runs 3"},
		{"unknown scenario in a list", func(o *options) { o.scenario = "herds,tsunami" }, `"tsunami"`},
		{"unknown strategy under steady load", func(o *options) { o.scenario, o.strategy = "steady-cut", "pray" }, `"pray"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := base
			tt.edit(&o)
			err := run(context.Background(), o, &bytes.Buffer{}, &bytes.Buffer{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run = %v, want an error naming %s", err, tt.want)
			}
		})
	}
}

func TestRunPrintsTableTreeAndSVG(t *testing.T) {
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	svg := filepath.Join(t.TempDir(), "storm.svg")
	waterfall := filepath.Join(t.TempDir(), "call.svg")
	var out, progress bytes.Buffer
	o := options{addr: addr, calls: 60, attempts: 5, base: time.Second, scale: 20, runs: 1,
		strategy: "exponential + full jitter", scenario: "published", trace: true, samples: 1, width: 40, svg: svg, traceSVG: waterfall}
	if err := run(context.Background(), o, &out, &progress); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"exponential + full jitter", "calls ok", "span tree", "├─ attempt 1", "backoff before attempt 2", "wrote " + svg, "wrote " + waterfall} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	m := regexp.MustCompile(`span tree, exponential \+ full jitter \(trace ([0-9a-f]{32})\):`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("the span tree names no trace id:\n%s", out.String())
	}
	// the waterfall draws the call whose tree was printed, from the client's own spans
	w, err := os.ReadFile(waterfall)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<svg", "trace " + m[1], "attempt 1", "backoff before attempt 2", "on the wire (otelgrpc)", "exponential + full jitter"} {
		if !bytes.Contains(w, []byte(want)) {
			t.Errorf("waterfall lacks %q", want)
		}
	}
	if !strings.Contains(progress.String(), "[1/1") {
		t.Errorf("no progress line: %q", progress.String())
	}
	b, err := os.ReadFile(svg)
	if err != nil || !bytes.HasPrefix(b, []byte("<svg")) {
		t.Errorf("svg file: %v, %.40q", err, b)
	}
}

func TestPickScenarios(t *testing.T) {
	o := options{calls: 10, attempts: 2, base: time.Millisecond, runs: 3, strategy: "no retries, herdguard defaults", scenario: "herd-20,steady"}
	got, err := pickScenarios(o)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range got {
		names = append(names, p.scenario.Name)
		if len(p.strategies) != 2 || p.strategies[0].Name != "no retries" || p.strategies[1].Name != "herdguard defaults" {
			t.Errorf("%s: strategies %v, want the two asked for", p.scenario.Name, p.strategies)
		}
	}
	want := []string{stormlab.Herd(20).Name, stormlab.SteadyCut().Name, stormlab.SteadyOutage().Name, stormlab.SteadyGentle().Name}
	if !slices.Equal(names, want) {
		t.Errorf("scenarios %q, want %q", names, want)
	}
	// -calls, -attempts and -base shape the herds, not the steady loads
	if h := got[0].scenario; h.Calls != 10 || h.Attempts != 2 || h.Base != time.Millisecond {
		t.Errorf("herd %+v: want the flags' calls, attempts and base", h)
	}
	if s := got[1].scenario; s.Attempts != 3 || s.Base != 100*time.Millisecond || s.Rate != 600 {
		t.Errorf("steady load %+v: want policy.Default's attempts and base, 600 calls/s", s)
	}
	o.compare = true
	got, _ = pickScenarios(o)
	if n := len(got[0].strategies); n != len(stormlab.HerdStrategies(stormlab.Herd(20))) {
		t.Errorf("-compare ran %d strategies in the herd", n)
	}
}

// TestRunComparedSteady runs a small steady load twice per strategy and
// prints the medians, the best possible, the outcomes and the goodput chart.
func TestRunComparedSteady(t *testing.T) {
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	sc := stormlab.Scenario{Name: "small", Rate: 200, Duration: 300 * time.Millisecond, Deadline: time.Second, Bucket: 50 * time.Millisecond,
		Faults: stormlab.Faults{Capacity: 100, TriggerAt: 100 * time.Millisecond, TriggerFor: 100 * time.Millisecond, TriggerOutage: true}}
	var out, windows bytes.Buffer
	section, rows, err := runCompared(context.Background(), &stormlab.Runner{Addr: addr}, plannedScenario{sc, []stormlab.Strategy{stormlab.NoRetriesStrategy()}},
		1, options{runs: 2, scale: 1, width: 40, windows: csv.NewWriter(&windows)}, &out)
	if err != nil {
		t.Fatal(err)
	}
	// -windows-csv: each run's windows, as many as the server counted.
	recs, err := csv.NewReader(&windows).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	perRun := map[string]int{}
	for _, rec := range recs {
		if rec[0] != "small" || rec[1] != stormlab.NoRetriesStrategy().Name || rec[2] != "1" {
			t.Errorf("-windows-csv row %v: want scenario small, no retries, 1 client", rec)
		}
		perRun[rec[3]]++
	}
	if d := perRun["1"] - perRun["2"]; len(perRun) != 2 || perRun["1"] < 3 || d < -1 || d > 1 {
		t.Errorf("-windows-csv: rows per run %v; want runs 1 and 2, each with the 3 or more windows of its 300 ms", perRun)
	}
	for _, want := range []string{"medians of 2 runs", "no retries", "best possible", "outcomes of the median run", "▒ marks the trigger", "error Unavailable"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if len(rows) != 1 || rows[0].Strategy != stormlab.NoRetriesStrategy().Name || rows[0].Calls != 60 {
		t.Errorf("the table's rows: %+v", rows)
	}
	if len(section.Results) != 1 || section.Results[0].Steady == nil || len(section.Results[0].Steady.Calls) != 60 {
		t.Errorf("the chart's section: %+v", section)
	}
}
