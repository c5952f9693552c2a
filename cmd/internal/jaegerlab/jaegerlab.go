// Package jaegerlab starts a real Jaeger v2 (the binary `make jaeger`
// builds from Jaeger's Go module) on 127.0.0.1 with free ports and reads
// traces back through its HTTP query API.
package jaegerlab

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/herdguard/herdguard/cmd/stormlab"
	"github.com/herdguard/herdguard/internal/proc"
)

// Options say which Jaeger to run and how.
type Options struct {
	Bin    string // the jaeger binary
	Config string // its configuration (tools/jaeger/config.yaml)
	UI     string // a jaeger-ui build to serve, or "" for Jaeger's placeholder page
	// Log receives Jaeger's own output; nil keeps the last 64 KiB for the
	// error of a Start that fails.
	Log io.Writer
	// Ready bounds the wait for Jaeger to listen; 0 means 60 s.
	Ready time.Duration
}

// Jaeger is a running Jaeger process.
type Jaeger struct {
	OTLP     string // OTLP gRPC receiver, host:port
	OTLPHTTP string // OTLP HTTP receiver, host:port
	QueryURL string // the query service (HTTP API and UI), http://host:port

	*proc.Process
	log *tail
}

// Start runs Jaeger with o's configuration on free loopback ports and
// returns once its receivers and its query service answer. Stop it with
// [proc.Process.Stop]; on Linux it also dies with the process that started it.
func Start(ctx context.Context, o Options) (*Jaeger, error) {
	if _, err := os.Stat(o.Bin); err != nil {
		return nil, fmt.Errorf("jaeger binary %s: %w (build it with `make jaeger`)", o.Bin, err)
	}
	cfg, err := filepath.Abs(o.Config)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(cfg); err != nil {
		return nil, fmt.Errorf("jaeger configuration: %w", err)
	}
	ui := o.UI
	if ui != "" {
		if ui, err = filepath.Abs(ui); err != nil {
			return nil, err
		}
		if _, err := os.Stat(filepath.Join(ui, "index.html")); err != nil {
			return nil, fmt.Errorf("jaeger-ui build: %w", err)
		}
	}
	ports, err := proc.FreePorts(4)
	if err != nil {
		return nil, err
	}
	j := &Jaeger{
		OTLP:     net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0])),
		OTLPHTTP: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1])),
		QueryURL: "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[2])),
		log:      &tail{max: 64 << 10},
	}
	env := append(os.Environ(),
		"JAEGER_OTLP_GRPC="+strconv.Itoa(ports[0]),
		"JAEGER_OTLP_HTTP="+strconv.Itoa(ports[1]),
		"JAEGER_QUERY_HTTP="+strconv.Itoa(ports[2]),
		"JAEGER_QUERY_GRPC="+strconv.Itoa(ports[3]),
		"JAEGER_UI="+ui,
	)
	var out io.Writer = j.log
	if o.Log != nil {
		out = io.MultiWriter(j.log, o.Log)
	}
	if j.Process, err = proc.Start(o.Bin, out, out, env, "--config", "file:"+cfg); err != nil {
		return nil, err
	}

	wait := o.Ready
	if wait <= 0 {
		wait = 60 * time.Second
	}
	if err := j.waitReady(ctx, wait); err != nil {
		j.Stop()
		return nil, fmt.Errorf("jaeger (pid %d) did not start: %w\n%s", j.PID(), err, j.log.String())
	}
	return j, nil
}

// Log returns the tail of Jaeger's output.
func (j *Jaeger) Log() string { return j.log.String() }

func (j *Jaeger) waitReady(ctx context.Context, bound time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := j.ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-j.Done():
			return fmt.Errorf("it exited: %v", j.Err())
		case <-ctx.Done():
			return fmt.Errorf("not ready within %v: %w", bound, err)
		case <-tick.C:
		}
	}
}

func (j *Jaeger) ready(ctx context.Context) error {
	for _, addr := range []string{j.OTLP, j.OTLPHTTP} {
		c, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return err
		}
		c.Close()
	}
	var services struct{ Data []string }
	return getJSON(ctx, j.QueryURL+"/api/services", &services)
}

// Services returns the names of the services Jaeger has spans of.
func (j *Jaeger) Services(ctx context.Context) ([]string, error) {
	var r struct{ Data []string }
	err := getJSON(ctx, j.QueryURL+"/api/services", &r)
	return r.Data, err
}

// Trace reads trace id (hex) back from Jaeger.
func (j *Jaeger) Trace(ctx context.Context, id string) ([]stormlab.TraceSpan, error) {
	return FetchTrace(ctx, j.QueryURL, id)
}

// TraceURL is where Jaeger's query service shows trace id.
func TraceURL(queryURL, id string) string { return queryURL + "/trace/" + id }

// FetchTrace reads trace id (hex) from the Jaeger query service at
// queryURL through its HTTP API (/api/traces/{id}).
func FetchTrace(ctx context.Context, queryURL, id string) ([]stormlab.TraceSpan, error) {
	var r apiTraces
	if err := getJSON(ctx, queryURL+"/api/traces/"+id, &r); err != nil {
		return nil, fmt.Errorf("trace %s: %w", id, err)
	}
	if len(r.Data) != 1 {
		return nil, fmt.Errorf("trace %s: Jaeger returned %d traces", id, len(r.Data))
	}
	return r.Data[0].spans(), nil
}

// apiTraces is the answer of Jaeger's /api/traces endpoints.
type apiTraces struct {
	Data []apiTrace `json:"data"`
}

type apiTrace struct {
	TraceID   string                `json:"traceID"`
	Spans     []apiSpan             `json:"spans"`
	Processes map[string]apiProcess `json:"processes"`
}

type apiSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64    `json:"startTime"` // µs since the epoch
	Duration  int64    `json:"duration"`  // µs
	Tags      []apiTag `json:"tags"`
	ProcessID string   `json:"processID"`
}

type apiProcess struct {
	ServiceName string   `json:"serviceName"`
	Tags        []apiTag `json:"tags"`
}

type apiTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func (t apiTrace) spans() []stormlab.TraceSpan {
	out := make([]stormlab.TraceSpan, 0, len(t.Spans))
	for _, s := range t.Spans {
		ts := stormlab.TraceSpan{
			TraceID:  t.TraceID,
			SpanID:   s.SpanID,
			Name:     s.OperationName,
			Start:    time.UnixMicro(s.StartTime),
			Duration: time.Duration(s.Duration) * time.Microsecond,
			Attrs:    map[string]string{},
			Kind:     "internal",
		}
		for _, ref := range s.References {
			if ref.RefType == "CHILD_OF" {
				ts.ParentID = ref.SpanID
			}
		}
		for _, tag := range s.Tags {
			ts.Attrs[tag.Key] = tagString(tag.Value)
		}
		if k := ts.Attrs["span.kind"]; k != "" {
			ts.Kind = k
		}
		p := t.Processes[s.ProcessID]
		ts.Service = p.ServiceName
		for _, tag := range p.Tags {
			ts.Resource = append(ts.Resource, [2]string{tag.Key, tagString(tag.Value)})
		}
		out = append(out, ts)
	}
	return out
}

func tagString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	case bool:
		return strconv.FormatBool(v)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Close = true // no idle connection outlives the call
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %.200s", url, resp.Status, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	buf bytes.Buffer
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf.Write(p)
	if over := t.buf.Len() - t.max; over > 0 {
		t.buf.Next(over)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.buf.String()
}
