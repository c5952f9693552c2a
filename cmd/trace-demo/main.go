// Command trace-demo shows a retry storm in a real Jaeger: it starts Jaeger
// (built by `make jaeger`), a traced demo-server and the demo-client on
// 127.0.0.1, prints the trace ids of retried calls with their Jaeger links,
// draws one of them as a waterfall, and stops every process it started by
// its process id, also on failure or Ctrl-C.
//
//	trace-demo                  # the demo, then stop everything
//	trace-demo -keep            # the demo, then keep Jaeger up until Ctrl-C
//	trace-demo -jaeger-only     # only Jaeger, until Ctrl-C (make jaeger)
//	trace-demo -mesh            # the mesh lab's chain, every tier traced (make trace-mesh)
//
// Both demo processes export to Jaeger's OTLP receiver; the client sends
// W3C trace context with every attempt, so one trace holds the call span,
// its attempts and backoff waits, otelgrpc's client span under each attempt
// and the server's span under that.
//
// With -mesh it runs the mesh lab's chain instead (demo-client -mesh,
// -scenario trace): user client -> gateway -> service -> leaf, every tier a
// demo-server process exporting to Jaeger as its service, the trace
// context carried down every hop; it prints user calls whose retries
// happened below the user, each layer's calls and attempts, and draws the
// first as a waterfall whose rows name their layer.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/herdguard/herdguard/cmd/internal/jaegerlab"
	"github.com/herdguard/herdguard/internal/proc"
)

type options struct {
	bin, config, ui, svg string
	strategy, scenario   string
	calls, samples       int
	scale                float64
	keep, jaegerOnly     bool
	mesh                 bool
	meshStrategy         string
	stdout, stderr       io.Writer
	jaegerLog            io.Writer
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("trace-demo: ")
	o := options{stdout: os.Stdout, stderr: os.Stderr}
	flag.StringVar(&o.bin, "bin", "bin", "the directory holding jaeger, demo-server and demo-client")
	flag.StringVar(&o.config, "config", "tools/jaeger/config.yaml", "Jaeger's configuration")
	flag.StringVar(&o.ui, "ui", "", "a jaeger-ui build for Jaeger to serve (its ui.assets_path); without it Jaeger shows a placeholder page")
	flag.StringVar(&o.svg, "trace-svg", "bin/trace.svg", "draw one retried call as a waterfall into this SVG file")
	flag.StringVar(&o.strategy, "strategy", "herdguard defaults", "the demo-client strategy")
	flag.StringVar(&o.scenario, "scenario", "published", "the demo-client scenario")
	flag.IntVar(&o.calls, "calls", 200, "calls in the herd")
	flag.IntVar(&o.samples, "trace-samples", 3, "how many retried calls to print")
	flag.Float64Var(&o.scale, "scale", 4, "divide every duration of the scenario by this")
	flag.BoolVar(&o.keep, "keep", false, "after the demo, keep Jaeger running until Ctrl-C")
	flag.BoolVar(&o.jaegerOnly, "jaeger-only", false, "run only Jaeger, until Ctrl-C")
	flag.BoolVar(&o.mesh, "mesh", false, "trace the mesh lab's chain, user -> gateway -> service -> leaf, every tier its own process")
	flag.StringVar(&o.meshStrategy, "mesh-strategy", "herdguard + server half", "-mesh: the mesh strategy of every hop")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		if ctx.Err() != nil {
			log.Print("interrupted; every process it started is stopped")
			os.Exit(130)
		}
		log.Fatal(err)
	}
}

func run(ctx context.Context, o options) error {
	jlog := o.jaegerLog
	if jlog == nil {
		jlog = prefixed(o.stderr, "jaeger: ")
	}
	j, err := jaegerlab.Start(ctx, jaegerlab.Options{Bin: filepath.Join(o.bin, "jaeger"), Config: o.config, UI: o.ui, Log: jlog})
	if err != nil {
		return err
	}
	defer j.Stop()
	fmt.Fprintf(o.stdout, "jaeger (pid %d): OTLP gRPC %s, OTLP HTTP %s, query and UI %s\n", j.PID(), j.OTLP, j.OTLPHTTP, j.QueryURL)
	if o.ui == "" {
		fmt.Fprintln(o.stdout, "  (the Jaeger built from its Go module serves a placeholder page; -ui dir, or make jaeger JAEGER_UI=dir, serves a jaeger-ui build)")
	}
	if o.jaegerOnly {
		fmt.Fprintln(o.stdout, "Ctrl-C stops it.")
		<-ctx.Done()
		return nil
	}
	play, what := demo, "retried calls"
	if o.mesh {
		play, what = meshDemo, "user calls retried below the user"
	}
	ids, err := play(ctx, j, o)
	if err != nil {
		return err
	}
	fmt.Fprintf(o.stdout, "\n%s, in Jaeger:\n", what)
	for _, id := range ids {
		fmt.Fprintf(o.stdout, "  %s  %s\n", id, jaegerlab.TraceURL(j.QueryURL, id))
	}
	fmt.Fprintf(o.stdout, "  the HTTP API: %s/api/traces/%s\n", j.QueryURL, ids[0])
	if o.keep {
		fmt.Fprintln(o.stdout, "Jaeger keeps running; Ctrl-C stops it.")
		<-ctx.Done()
	}
	return nil
}

// traceLine matches the header demo-client -trace prints for each call.
var traceLine = regexp.MustCompile(`^span tree, .* \(trace ([0-9a-f]{32})\):$`)

// demo runs a traced demo-server and the demo-client against Jaeger j,
// stops the server so its last spans are flushed, and returns the trace
// ids of the retried calls the client printed.
func demo(ctx context.Context, j *jaegerlab.Jaeger, o options) ([]string, error) {
	dir, err := os.MkdirTemp("", "trace-demo")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	addrFile := filepath.Join(dir, "addr")
	server, err := start(filepath.Join(o.bin, "demo-server"), o.stderr, o.stderr,
		"-addr", "127.0.0.1:0", "-addr-file", addrFile, "-otlp", j.OTLP)
	if err != nil {
		return nil, err
	}
	defer server.Stop()
	addr, err := waitFile(ctx, addrFile, server, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("demo-server (pid %d): %w", server.PID(), err)
	}
	fmt.Fprintf(o.stdout, "demo-server (pid %d) on %s\n", server.PID(), addr)

	var out bytes.Buffer
	client, err := start(filepath.Join(o.bin, "demo-client"), io.MultiWriter(o.stdout, &out), o.stderr,
		"-addr", addr, "-otlp", j.OTLP, "-jaeger", j.QueryURL,
		"-strategy", o.strategy, "-scenario", o.scenario, "-calls", strconv.Itoa(o.calls),
		"-scale", strconv.FormatFloat(o.scale, 'g', -1, 64),
		"-trace", "-trace-samples", strconv.Itoa(o.samples), "-trace-svg", o.svg)
	if err != nil {
		return nil, err
	}
	defer client.Stop()
	fmt.Fprintf(o.stdout, "demo-client (pid %d)\n", client.PID())
	if err := client.Wait(ctx); err != nil {
		return nil, fmt.Errorf("demo-client (pid %d): %w", client.PID(), err)
	}
	if err := server.Stop(); err != nil {
		return nil, fmt.Errorf("demo-server (pid %d): %w", server.PID(), err)
	}
	return traceIDs(out.String(), traceLine, "demo-client printed no retried call")
}

// meshTraceLine matches the header demo-client -mesh -trace prints for
// each user call it found retried below the user.
var meshTraceLine = regexp.MustCompile(`^mesh trace, .* \(trace ([0-9a-f]{32})\):$`)

// meshDemo runs the mesh lab's chain, traced, against Jaeger j (the
// demo-client starts and stops the leaf and the tiers), and returns the
// trace ids of the user calls it printed.
func meshDemo(ctx context.Context, j *jaegerlab.Jaeger, o options) ([]string, error) {
	var out bytes.Buffer
	client, err := start(filepath.Join(o.bin, "demo-client"), io.MultiWriter(o.stdout, &out), o.stderr,
		"-mesh", "-server-bin", filepath.Join(o.bin, "demo-server"), "-otlp", j.OTLP, "-jaeger", j.QueryURL,
		"-scenario", "trace", "-mesh-strategies", o.meshStrategy, "-runs", "1",
		"-trace", "-trace-samples", strconv.Itoa(o.samples), "-trace-svg", o.svg)
	if err != nil {
		return nil, err
	}
	defer client.Stop()
	fmt.Fprintf(o.stdout, "demo-client -mesh (pid %d): the chain user -> gateway -> service -> leaf, strategy %q\n", client.PID(), o.meshStrategy)
	if err := client.Wait(ctx); err != nil {
		return nil, fmt.Errorf("demo-client (pid %d): %w", client.PID(), err)
	}
	return traceIDs(out.String(), meshTraceLine, "demo-client -mesh printed no user call retried below the user")
}

// traceIDs returns the trace ids of the lines of out that match header,
// each once, in order; none is the error none.
func traceIDs(out string, header *regexp.Regexp, none string) ([]string, error) {
	var ids []string
	for _, line := range strings.Split(out, "\n") {
		if m := header.FindStringSubmatch(line); m != nil && !slices.Contains(ids, m[1]) {
			ids = append(ids, m[1])
		}
	}
	if len(ids) == 0 {
		return nil, errors.New(none)
	}
	return ids, nil
}

// start starts a demo binary, saying how to build it when it is missing.
func start(bin string, stdout, stderr io.Writer, args ...string) (*proc.Process, error) {
	p, err := proc.Start(bin, stdout, stderr, nil, args...)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w (build it with `make build`)", err)
	}
	return p, err
}

// waitFile waits for the file a starting server writes its address to.
func waitFile(ctx context.Context, path string, p *proc.Process, bound time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	for {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return string(b), nil
		}
		select {
		case <-p.Done():
			return "", fmt.Errorf("exited before listening: %v", p.Err())
		case <-ctx.Done():
			return "", fmt.Errorf("no address in %s within %v", path, bound)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// prefixed writes each line to w after prefix.
func prefixed(w io.Writer, prefix string) io.Writer {
	return &prefixWriter{w: w, prefix: prefix, bol: true}
}

type prefixWriter struct {
	w      io.Writer
	prefix string
	bol    bool
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	var out []byte
	for _, c := range b {
		if p.bol {
			out = append(out, p.prefix...)
		}
		out = append(out, c)
		p.bol = c == '\n'
	}
	_, err := p.w.Write(out)
	return len(b), err
}
