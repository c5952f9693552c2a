package stormlab

import (
	"encoding/csv"
	"encoding/xml"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// TestWriteSVGEmptySection: a section with no results adds nothing to the
// chart (and does not read its first result), and a chart with no results
// at all is still a well-formed SVG document.
func TestWriteSVGEmptySection(t *testing.T) {
	rs := []Result{{Strategy: "a", Stats: fakeStats(100, []int64{0, 7, 2}, 5000, 1200)}}
	var one strings.Builder
	if err := WriteSVG(&one, []SVGSection{{Title: "t", Results: rs}}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		sections []SVGSection
		want     string // "" for an empty chart
	}{
		{"no sections", nil, ""},
		{"one empty section", []SVGSection{{Title: "empty"}}, ""},
		{"empty sections around one with results",
			[]SVGSection{{Title: "empty"}, {Title: "t", Results: rs}, {Title: "also empty", Results: []Result{}}}, one.String()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b strings.Builder
			if err := WriteSVG(&b, tt.sections); err != nil {
				t.Fatalf("WriteSVG: %v", err)
			}
			got := b.String()
			if err := wellFormed(got); err != nil || !strings.HasPrefix(got, "<svg") {
				t.Errorf("WriteSVG = %q (%v), want a well-formed <svg> document", got, err)
			}
			if strings.Contains(got, "empty") {
				t.Errorf("an empty section left its title:\n%s", got)
			}
			switch {
			case tt.want == "" && strings.Contains(got, "<text"):
				t.Errorf("WriteSVG of no results drew something:\n%s", got)
			case tt.want != "" && got != tt.want:
				t.Errorf("WriteSVG =\n%s\nwant the chart of the one section with results:\n%s", got, tt.want)
			}
		})
	}
}

// wellFormed reports whether s is well-formed XML.
func wellFormed(s string) error {
	d := xml.NewDecoder(strings.NewReader(s))
	for {
		if _, err := d.Token(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}

// steadyResult is a steady-load result whose calls end ok in every bucket
// but those listed as failing, 4 calls per 250 ms bucket over 3 s, with a
// trigger from 1 s to 2 s.
func steadyResult(name string, failing ...int) Result {
	s := &Steady{Bucket: 250 * time.Millisecond, TriggerStart: time.Second, TriggerEnd: 2 * time.Second, Rate: 16}
	r := Result{Strategy: name, Steady: s, Stats: &demov1.GetStatsResponse{}}
	for b := range 12 {
		for k := range 4 {
			o := "ok"
			if slices.Contains(failing, b) {
				o = "exhausted"
			} else {
				r.Succeeded++
			}
			s.Calls = append(s.Calls, Completion{End: time.Duration(b)*s.Bucket + time.Duration(k)*time.Millisecond, Outcome: o})
		}
	}
	r.Calls = len(s.Calls)
	return r
}

func TestWriteGoodput(t *testing.T) {
	rs := []Result{steadyResult("calm"), steadyResult("a<b>", 4, 5, 6, 7, 8, 9)}
	var b strings.Builder
	if err := WriteGoodput(&b, rs, 72); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	want := []string{
		"trigger |    ▒▒▒▒    |",
		"calm    |████████████| ok 100.0 %",
		"a<b>    |████      ██| ok 50.0 %",
	}
	if len(lines) != 4 || !strings.Contains(lines[0], "full bar = 4 calls") || !slices.Equal(lines[1:], want) {
		t.Errorf("WriteGoodput =\n%s\nwant under its header:\n%s", b.String(), strings.Join(want, "\n"))
	}
	// folded: two buckets per column, each column their mean
	b.Reset()
	WriteGoodput(&b, rs[1:], 6)
	if got := strings.Split(b.String(), "\n")[2]; got != "a<b>    |██   █| ok 50.0 %" {
		t.Errorf("folded row %q", got)
	}
	for _, in := range [][]Result{nil, {{Strategy: "herd", Stats: fakeStats(100, []int64{1}, 0, 0)}}} {
		b.Reset()
		if err := WriteGoodput(&b, in, 72); err != nil || b.Len() != 0 {
			t.Errorf("WriteGoodput of no steady results: %q, %v; want nothing", b.String(), err)
		}
	}
}

func TestWriteGoodputSVG(t *testing.T) {
	rs := []Result{steadyResult("calm"), steadyResult("a<b>", 4, 5, 6, 7, 8, 9)}
	var b strings.Builder
	if err := WriteGoodputSVG(&b, []SVGSection{{Title: "cut & run", Results: rs}}); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	if err := wellFormed(svg); err != nil {
		t.Fatalf("not well-formed: %v\n%s", err, svg)
	}
	for _, want := range []string{"<polyline", "cut &amp; run", "a&lt;b&gt; (50.0 % ok)", "calm (100.0 % ok)", `fill="#f3d9d9"`, "calls offered", ">3s<"} {
		if !strings.Contains(svg, want) {
			t.Errorf("svg lacks %q", want)
		}
	}
	if n := strings.Count(svg, "<polyline"); n != 2 {
		t.Errorf("%d polylines, want one per strategy", n)
	}
	// a polyline point per bucket: the failing buckets of a<b> sit on the axis
	if !strings.Contains(svg, fmt.Sprintf("%.1f,%.1f", 60+800*(4.5/12.0), float64(40+240))) {
		t.Errorf("the first failing bucket of a<b> is not at 0:\n%s", svg)
	}

	for _, tt := range []struct {
		name     string
		sections []SVGSection
	}{
		{"no sections", nil},
		{"an empty section", []SVGSection{{Title: "empty"}}},
		{"a section of herd results", []SVGSection{{Title: "herd", Results: []Result{{Strategy: "x", Stats: fakeStats(100, []int64{1}, 0, 0)}}}}},
		{"a section of results without completions", []SVGSection{{Title: "nothing", Results: []Result{{Strategy: "x", Steady: &Steady{Bucket: time.Second}}}}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var b strings.Builder
			if err := WriteGoodputSVG(&b, tt.sections); err != nil {
				t.Fatal(err)
			}
			if err := wellFormed(b.String()); err != nil || !strings.HasPrefix(b.String(), "<svg") {
				t.Errorf("WriteGoodputSVG = %q (%v), want a well-formed <svg>", b.String(), err)
			}
			if tt.name != "a section of results without completions" && strings.Contains(b.String(), "<text") {
				t.Errorf("drew something of nothing:\n%s", b.String())
			}
		})
	}
}

func TestWriteSteadyAndHerdTables(t *testing.T) {
	rows := []Summary{
		{Strategy: "no retries", Runs: 3, Calls: 7200, OK: 5400, AttemptsPerCall: 1, Recovery: time.Second, P50: 400 * time.Microsecond, P99: 2 * time.Millisecond},
		{Strategy: "storm", Runs: 3, Calls: 7200, OK: 1800, AttemptsPerCall: 2.49, Never: true},
	}
	var b strings.Builder
	if err := WriteSteadyTable(&b, Bound{Calls: 7200, OK: 6696, Attempts: 7200}, rows); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"medians of 3 runs", "75.0 %", "1.00s", "never", "2.49", "best possible", "6696", "93.0 %", "400µs"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("steady table lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	hb, _ := Herd(80).Bound()
	if err := WriteHerdTable(&b, hb, []Summary{{Strategy: "h", Runs: 1, OK: 995, Attempts: 3840, LastSuccess: 4400 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if lines[0] != "least possible: 1920 attempts, last success at 2.20s" ||
		strings.Join(strings.Fields(lines[len(lines)-2]), " ") != "h 995 3840 2.00 4.40s 2.00 0 0" ||
		strings.Join(strings.Fields(lines[len(lines)-1]), " ") != "least possible 1000 1920 1.00 2.20s 1.00" {
		t.Errorf("herd table:\n%s", b.String())
	}
	if strings.Contains(b.String(), "medians") {
		t.Errorf("one run is not a median:\n%s", b.String())
	}
}

// The partial-failure table shows, per strategy, the calls ok at each p
// and the dead server's attempts and failed-call latency; PartialHarm
// names each broken promise; the chart draws a line per strategy.
func TestPartialTableAndHarm(t *testing.T) {
	cell := func(p float64, ok int, okPerSec, attempts float64, failed time.Duration) PartialCell {
		return PartialCell{P: p, Runs: 1, Calls: 1000, OK: ok, OKPerSec: okPerSec, AttemptsPerSec: attempts, FailedP50: failed}
	}
	alone := PartialRow{Strategy: RetriesAlone, Cells: []PartialCell{cell(0.67, 700, 7000, 1300, 0), cell(1, 0, 0, 1800, 150*time.Millisecond)}}
	good := PartialRow{Strategy: HerdguardDefault, Cells: []PartialCell{cell(0.67, 695, 6000, 1280, 0), cell(1, 0, 0, 13, 50*time.Microsecond)}}
	var b strings.Builder
	if err := WritePartialTable(&b, false, []PartialRow{alone, good}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"calls ok at p = 0.67", "dead server: attempts/s", "70.0 %", "69.5 %", "1800", "150ms", "<0.1ms"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("open-loop table lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	if err := WritePartialTable(&b, true, []PartialRow{alone, good}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "ok calls/s at p = 0.67") || !strings.Contains(b.String(), "6000") {
		t.Errorf("closed-loop table:\n%s", b.String())
	}
	if errs := PartialHarm([]PartialRow{alone, good}, false); len(errs) != 0 {
		t.Errorf("open loop, no harm done: %v", errs)
	}
	if errs := PartialHarm([]PartialRow{alone, good}, true); len(errs) != 1 || !strings.Contains(errs[0].Error(), "6000") {
		t.Errorf("closed loop, 6000 ok calls/s against 7000: %v, want that named", errs)
	}
	bad := PartialRow{Strategy: HerdguardDefault, Cells: []PartialCell{cell(0.67, 680, 7000, 1280, 0), cell(1, 0, 0, 200, 2*time.Second)}}
	if errs := PartialHarm([]PartialRow{alone, bad}, false); len(errs) != 3 {
		t.Errorf("open loop, 2 points fewer, 200 attempts/s and calls that wait 2 s at a dead server: %v, want 3 errors", errs)
	}
	b.Reset()
	if err := WritePartialSVG(&b, []PartialRow{alone, good}, []PartialRow{alone}); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(b.String(), "<polyline"); n != 3 || !strings.Contains(b.String(), "closed loop") {
		t.Errorf("chart has %d lines, want 3 in two charts:\n%s", n, b.String())
	}
}

// TestWriteWindows: a row per window of the server's counts, the window's
// start from its width, under the header's columns.
func TestWriteWindows(t *testing.T) {
	r := Result{Scenario: "s", Strategy: "herdguard defaults", Stats: &demov1.GetStatsResponse{WindowMs: 100, Windows: []*demov1.Window{
		{FirstAttempts: 60, Succeeded: 60},
		{FirstAttempts: 82, Retries: 3, Failed: 5, Succeeded: 80},
	}}}
	got := writeCSV(t, WindowsHeader, func(w *csv.Writer) error { return WriteWindows(w, 100, 2, r) })
	want := "scenario,strategy,clients,run,window_start_ms,first_attempts,retries,failed,succeeded\n" +
		"s,herdguard defaults,100,2,0,60,0,0,60\n" +
		"s,herdguard defaults,100,2,100,82,3,5,80\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

// TestWriteCalls: a row per call of a brownout run, times in ms since its
// first call; a herd's run writes none.
func TestWriteCalls(t *testing.T) {
	r := Result{Scenario: "s", Strategy: "herdguard defaults", Steady: &Steady{Calls: []Completion{
		{Start: 0, End: 1500 * time.Microsecond, Outcome: "ok"},
		{Start: 3 * time.Second, End: 5 * time.Second, Outcome: "error DeadlineExceeded"},
	}}}
	got := writeCSV(t, CallsHeader, func(w *csv.Writer) error {
		if err := WriteCalls(w, 40, 3, r); err != nil {
			return err
		}
		return WriteCalls(w, 40, 1, Result{Scenario: "herd"})
	})
	want := "scenario,strategy,clients,run,start_ms,end_ms,outcome\n" +
		"s,herdguard defaults,40,3,0.0,1.5,ok\n" +
		"s,herdguard defaults,40,3,3000.0,5000.0,error DeadlineExceeded\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

// writeCSV is what write writes under header.
func writeCSV(t *testing.T, header []string, write func(*csv.Writer) error) string {
	t.Helper()
	var b strings.Builder
	w := csv.NewWriter(&b)
	if err := w.Write(header); err != nil {
		t.Fatal(err)
	}
	if err := write(w); err != nil {
		t.Fatal(err)
	}
	return b.String()
}
