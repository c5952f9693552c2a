package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	"github.com/herdguard/herdguard/cmd/internal/jaegerlab"
	"github.com/herdguard/herdguard/cmd/stormlab"
)

// e2e returns the options of an end-to-end run, or skips the test unless
// it runs under `make e2e`, which builds Jaeger and the demo first.
func e2e(t *testing.T) options {
	t.Helper()
	if os.Getenv("HERDGUARD_E2E") == "" {
		t.Skip("end-to-end test against a real Jaeger: run `make e2e` (it builds Jaeger from its Go module with `make jaeger`)")
	}
	bin := os.Getenv("HERDGUARD_BIN")
	if bin == "" {
		bin = "../../bin"
	}
	for _, b := range []string{"jaeger", "demo-server", "demo-client"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Fatalf("%v: `make e2e` builds it", err)
		}
	}
	return options{bin: bin, config: "../../tools/jaeger/config.yaml", svg: filepath.Join(t.TempDir(), "trace.svg"),
		strategy: "herdguard defaults", scenario: "published", calls: 100, samples: 3, scale: 4}
}

// TestE2ETracesInJaeger runs the trace demo against a real Jaeger and reads
// every printed trace back through Jaeger's HTTP API: one trace per call,
// holding the call span, its attempts and backoff waits, otelgrpc's client
// span under each attempt and the demo server's span under that, with the
// documented attributes and both services named.
func TestE2ETracesInJaeger(t *testing.T) {
	o := e2e(t)
	ctx, j, out := startE2E(t, &o)

	ids, err := demo(ctx, j, o)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != o.samples {
		t.Errorf("%d trace ids printed, want %d", len(ids), o.samples)
	}
	m := regexp.MustCompile(`demo-server \(pid \d+\) on 127\.0\.0\.1:(\d+)`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatal("trace-demo did not print the demo server's address")
	}
	serverPort := m[1]
	for _, id := range ids {
		if !strings.Contains(out.String(), jaegerlab.TraceURL(j.QueryURL, id)) {
			t.Errorf("no Jaeger link printed for trace %s", id)
		}
		spans, err := whole(ctx, j, id)
		if err != nil {
			t.Fatal(err)
		}
		checkTrace(t, id, spans, serverPort)
	}

	services, err := j.Services(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"demo-client", "demo-server"} {
		if !slices.Contains(services, want) {
			t.Errorf("Jaeger's services %v lack %s", services, want)
		}
	}
	svg, err := os.ReadFile(o.svg)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<svg", "attempt 1", "backoff before attempt 2", "server (demo-server)", ids[0]} {
		if !bytes.Contains(svg, []byte(want)) {
			t.Errorf("the waterfall lacks %q", want)
		}
	}

	pid := j.PID()
	j.Stop()
	if alive(pid) {
		t.Errorf("jaeger (pid %d) still runs after Stop", pid)
	}
}

// startE2E sends o's output to buffers that the test logs if it fails,
// and starts Jaeger, stopped with the test; the context bounds the test
// (5 minutes). It returns the output buffer.
func startE2E(t *testing.T, o *options) (context.Context, *jaegerlab.Jaeger, *syncBuffer) {
	t.Helper()
	out, logs := &syncBuffer{}, &syncBuffer{}
	o.stdout, o.stderr, o.jaegerLog = out, logs, logs
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("output:\n%s\nlogs:\n%s", out.String(), logs.String())
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	j, err := jaegerlab.Start(ctx, jaegerlab.Options{Bin: filepath.Join(o.bin, "jaeger"), Config: o.config, Log: logs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = j.Stop() })
	return ctx, j, out
}

// whole reads trace id back from Jaeger once Jaeger has stored all of it,
// which it does a little after the exporters sent it: a root (the call
// span) whose herdguard.attempts n accounts for every span, that is n
// attempts, each with a client and a server span under it, and the waits
// between them (n-1 backoffs, or waits in the overload controller's line
// while it paced the target, which it may at first sight of a burst's
// failures).
func whole(ctx context.Context, j *jaegerlab.Jaeger, id string) ([]stormlab.TraceSpan, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	for {
		spans, err := j.Trace(ctx, id)
		if err == nil && complete(spans) {
			return spans, nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				return spans, nil // incomplete: checkTrace says what is missing
			}
			return nil, err
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// complete reports whether spans hold a root call span with
// herdguard.attempts n, n attempt spans and, for each, a client and a
// server span; waits come with the attempts they precede.
func complete(spans []stormlab.TraceSpan) bool {
	var n, attempts, wire, server int
	for _, s := range spans {
		switch {
		case s.ParentID == "":
			n, _ = strconv.Atoi(s.Attrs["herdguard.attempts"])
		case s.Name == telemetry.SpanAttempt:
			attempts++
		case s.Kind == "client":
			wire++
		case s.Kind == "server":
			server++
		}
	}
	return n > 0 && attempts == n && wire == n && server == n
}

// checkTrace checks one retried call's trace as Jaeger returns it.
func checkTrace(t *testing.T, id string, spans []stormlab.TraceSpan, serverPort string) {
	t.Helper()
	tree, _, err := stormlab.TraceTree(spans)
	if err != nil {
		t.Fatalf("trace %s: %v", id, err)
	}
	byParent := map[string][]stormlab.TraceSpan{}
	for _, s := range tree {
		byParent[s.ParentID] = append(byParent[s.ParentID], s)
	}
	root := tree[0]
	const method = "herdguard.demo.v1.GatewayService/Charge"
	want := map[string]string{
		"span.kind":          "client",
		"rpc.system.name":    "grpc",
		"rpc.method":         method,
		"server.address":     "127.0.0.1",
		"server.port":        serverPort,
		"stormlab.strategy":  "herdguard defaults",
		"stormlab.scenario":  stormlab.Published().Name,
		"herdguard.outcome":  "",
		"herdguard.attempts": "",
	}
	for k, v := range want {
		got, ok := root.Attrs[k]
		if !ok || (v != "" && got != v) {
			t.Errorf("trace %s: call span %s = %q (set: %v), want %q", id, k, got, ok, v)
		}
	}
	if root.Name != method || root.Service != "demo-client" {
		t.Errorf("trace %s: root span %q of %q, want the call span of demo-client", id, root.Name, root.Service)
	}
	if v := resource(root, "service.version"); v != telemetry.Version {
		t.Errorf("trace %s: demo-client's service.version %q, want %q", id, v, telemetry.Version)
	}
	n, _ := strconv.Atoi(root.Attrs["herdguard.attempts"])
	if n < 2 {
		t.Fatalf("trace %s: herdguard.attempts = %d, want a retried call", id, n)
	}
	if code := root.StatusCode(); (code == "OK") != (root.Attrs["error.type"] == "") {
		t.Errorf("trace %s: status %s with error.type %q", id, code, root.Attrs["error.type"])
	}

	// Under the call: its attempts, and before each retry its waits: a
	// backoff, a wait in the overload controller's line (held), or both,
	// one of each at most. A first attempt may be held too.
	var attempts []stormlab.TraceSpan
	waits := map[string][]stormlab.TraceSpan{} // by the attempt they precede
	for _, c := range byParent[root.SpanID] {
		switch c.Name {
		case telemetry.SpanAttempt:
			attempts = append(attempts, c)
		case telemetry.SpanBackoff, telemetry.SpanHeld:
			before := c.Attrs["herdguard.attempt"]
			if slices.ContainsFunc(waits[before], func(w stormlab.TraceSpan) bool { return w.Name == c.Name }) {
				t.Errorf("trace %s: two %q spans before attempt %s", id, c.Name, before)
			}
			waits[before] = append(waits[before], c)
		default:
			t.Errorf("trace %s: unexpected child %q of the call span", id, c.Name)
		}
	}
	if len(attempts) != n {
		t.Fatalf("trace %s: %d attempts under the call, want %d", id, len(attempts), n)
	}
	for before, ws := range waits {
		isBackoff := func(w stormlab.TraceSpan) bool { return w.Name == telemetry.SpanBackoff }
		if k, err := strconv.Atoi(before); err != nil || k < 1 || k > n || k == 1 && slices.ContainsFunc(ws, isBackoff) {
			t.Errorf("trace %s: waits %v before attempt %q, of %d", id, names(ws), before, n)
		}
	}
	for i, a := range attempts {
		if a.Attrs["herdguard.attempt"] != strconv.Itoa(i+1) || a.Attrs["rpc.method"] != method || a.Service != "demo-client" {
			t.Errorf("trace %s: attempt %d has herdguard.attempt %q, rpc.method %q, service %q", id, i+1,
				a.Attrs["herdguard.attempt"], a.Attrs["rpc.method"], a.Service)
		}
		ws := waits[strconv.Itoa(i+1)]
		if i > 0 && len(ws) == 0 {
			t.Errorf("trace %s: attempt %d follows no backoff and no wait in the controller's line", id, i+1)
		}
		for _, w := range ws {
			after := root.Start
			if i > 0 {
				after = attempts[i-1].End()
			}
			if w.Start.Before(after.Add(-time.Millisecond)) || w.End().After(a.Start.Add(time.Millisecond)) {
				t.Errorf("trace %s: %s before attempt %d (%v to %v) is not between attempts %d and %d",
					id, w.Name, i+1, w.Start, w.End(), i, i+1)
			}
		}
		// under each attempt: otelgrpc's client span, and the server's span under it
		wire := byParent[a.SpanID]
		if len(wire) != 1 || wire[0].Kind != "client" || wire[0].Name != method || wire[0].Service != "demo-client" {
			t.Errorf("trace %s: attempt %d has children %v, want one client span of otelgrpc", id, i+1, names(wire))
			continue
		}
		srv := byParent[wire[0].SpanID]
		if len(srv) != 1 || srv[0].Kind != "server" || srv[0].Service != "demo-server" || srv[0].Name != method {
			t.Errorf("trace %s: attempt %d's wire span has children %v, want the demo-server's server span", id, i+1, names(srv))
			continue
		}
		if srv[0].StatusCode() != a.StatusCode() {
			t.Errorf("trace %s: attempt %d ended %s, its server span %s", id, i+1, a.StatusCode(), srv[0].StatusCode())
		}
		if srv[0].Start.Before(a.Start.Add(-time.Millisecond)) || srv[0].End().After(a.End().Add(time.Millisecond)) {
			t.Errorf("trace %s: attempt %d's server span (%v to %v) is not inside it (%v to %v)", id, i+1,
				srv[0].Start, srv[0].End(), a.Start, a.End())
		}
		if v := resource(srv[0], "service.version"); v != telemetry.Version {
			t.Errorf("trace %s: demo-server's service.version %q", id, v)
		}
	}
	if last := attempts[n-1].StatusCode(); last != root.StatusCode() {
		t.Errorf("trace %s: the last attempt ended %s, the call %s", id, last, root.StatusCode())
	}
}

// TestE2EInterruptStopsEverything cancels the demo while it runs, as Ctrl-C
// does, and checks that Jaeger and the demo server and client it started
// are gone.
func TestE2EInterruptStopsEverything(t *testing.T) {
	o := e2e(t)
	o.calls, o.scale = 1000, 1 // a run of several seconds, to interrupt
	var logs syncBuffer
	pids := make(chan int, 3)
	o.stdout = &pidWatcher{pids: pids}
	o.stderr, o.jaegerLog = &logs, &logs
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, o) }()
	var seen []int
	for len(seen) < 3 {
		select {
		case p := <-pids:
			seen = append(seen, p)
		case err := <-done:
			t.Fatalf("run ended before every process started: %v\n%s", err, logs.String())
		case <-time.After(2 * time.Minute):
			t.Fatalf("no pids printed\n%s", logs.String())
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("run = %v, want it to end with the cancellation", err)
	}
	for _, p := range seen {
		if alive(p) {
			t.Errorf("pid %d still runs after the demo was interrupted", p)
		}
	}
}

// pidWatcher sends the pids trace-demo prints for the processes it starts.
type pidWatcher struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	pids chan int
}

var pidLine = regexp.MustCompile(`^(?:jaeger|demo-server|demo-client) \(pid (\d+)\)`)

func (w *pidWatcher) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for {
		line, err := w.buf.ReadString('\n')
		if err != nil {
			w.buf.Reset()
			w.buf.WriteString(line)
			return len(p), nil
		}
		if m := pidLine.FindStringSubmatch(line); m != nil {
			pid, _ := strconv.Atoi(m[1])
			w.pids <- pid
		}
	}
}

func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }

func resource(s stormlab.TraceSpan, key string) string {
	for _, kv := range s.Resource {
		if kv[0] == key {
			return kv[1]
		}
	}
	return ""
}

func names(spans []stormlab.TraceSpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Kind+" "+s.Name+" of "+s.Service)
	}
	return out
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestE2EServesAJaegerUIBuild: with -ui (make jaeger JAEGER_UI=dir) Jaeger
// serves that directory as its UI instead of its placeholder page.
func TestE2EServesAJaegerUIBuild(t *testing.T) {
	o := e2e(t)
	ui := t.TempDir()
	const marker = "herdguard-ui-marker"
	if err := os.WriteFile(filepath.Join(ui, "index.html"), []byte("<html><head><base href=\"/\"></head><body>"+marker+"</body></html>"), 0o644); err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	j, err := jaegerlab.Start(ctx, jaegerlab.Options{Bin: filepath.Join(o.bin, "jaeger"), Config: o.config, UI: ui, Log: &logs})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, j.QueryURL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.Contains(body, []byte(marker)) {
		t.Errorf("GET / = %s, %v: want the UI build's index.html\n%.300s\n%s", resp.Status, err, body, logs.String())
	}

	if _, err := jaegerlab.Start(ctx, jaegerlab.Options{Bin: filepath.Join(o.bin, "jaeger"), Config: o.config, UI: t.TempDir()}); err == nil ||
		!strings.Contains(err.Error(), "index.html") {
		t.Errorf("a UI directory without index.html: %v, want an error naming index.html", err)
	}
}
