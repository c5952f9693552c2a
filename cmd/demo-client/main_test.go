package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/herdguard/herdguard/internal/stormlab"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRejectsBadFlags(t *testing.T) {
	base := options{addr: "127.0.0.1:1", calls: 10, attempts: 3, base: time.Second, scale: 1, strategy: "herdguard defaults"}
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
	o := options{addr: addr, calls: 60, attempts: 5, base: time.Second, scale: 20,
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
