package conformance

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	oteltrace "go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/grpclog"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/herdguard/herdguard/interceptor"
)

const (
	// caseTimeout bounds each interop case.
	caseTimeout = 30 * time.Second

	// The soak cases, kept small: 5 modes × 2 soaks run in well under a
	// minute under -race on 2 shared cores. Sizes are the interop client's
	// defaults.
	soakIterations   = 10
	soakWorkers      = 2
	soakRequestSize  = 271828
	soakResponseSize = 314159
	// soakMaxLatency is how long one soak iteration (a large unary call)
	// may take before it counts as a failure: wide, for -race on a shared
	// machine, where the interop client's default is 1s.
	soakMaxLatency = 5 * time.Second
	soakOverall    = 60 * time.Second

	// sleepingServerRuns is how many times the TestTimeoutOnSleepingServer
	// tests run that case per herdguard mode; it once raced about once in
	// 250 runs.
	sleepingServerRuns = 50
)

func TestMain(m *testing.M) {
	grpclog.SetLoggerV2(logger) // before any use of gRPC
	goleak.VerifyTestMain(m)
}

// testLogger is gRPC's logger in these tests. Its Fatal fails the running
// test, where grpclog's would exit the process after it returns: t.Fatalf
// does not return. The interop cases call Fatal on the goroutine that runs
// them, the test's. Warnings and errors go to the running test's log;
// informational messages are dropped.
type testLogger struct {
	mu sync.Mutex
	t  *testing.T // the running test; nil between tests
}

var logger = &testLogger{}

// bind makes t the running test until it ends.
func (l *testLogger) bind(t *testing.T) {
	l.mu.Lock()
	l.t = t
	l.mu.Unlock()
	t.Cleanup(func() { // before t completes: no log reaches it after
		l.mu.Lock()
		if l.t == t {
			l.t = nil
		}
		l.mu.Unlock()
	})
}

func (l *testLogger) log(severity, msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.t != nil {
		l.t.Logf("grpclog %s: %s", severity, msg)
	}
}

func (l *testLogger) fatal(msg string) {
	l.mu.Lock()
	t := l.t
	l.mu.Unlock()
	if t == nil {
		panic("grpclog fatal outside any test: " + msg)
	}
	t.Fatalf("grpclog fatal: %s", msg)
}

func (l *testLogger) Info(...any)                    {}
func (l *testLogger) Infoln(...any)                  {}
func (l *testLogger) Infof(string, ...any)           {}
func (l *testLogger) Warning(args ...any)            { l.log("warning", fmt.Sprint(args...)) }
func (l *testLogger) Warningln(args ...any)          { l.log("warning", fmt.Sprintln(args...)) }
func (l *testLogger) Warningf(f string, args ...any) { l.log("warning", fmt.Sprintf(f, args...)) }
func (l *testLogger) Error(args ...any)              { l.log("error", fmt.Sprint(args...)) }
func (l *testLogger) Errorln(args ...any)            { l.log("error", fmt.Sprintln(args...)) }
func (l *testLogger) Errorf(f string, args ...any)   { l.log("error", fmt.Sprintf(f, args...)) }
func (l *testLogger) Fatal(args ...any)              { l.fatal(fmt.Sprint(args...)) }
func (l *testLogger) Fatalln(args ...any)            { l.fatal(fmt.Sprintln(args...)) }
func (l *testLogger) Fatalf(f string, args ...any)   { l.fatal(fmt.Sprintf(f, args...)) }
func (l *testLogger) V(int) bool                     { return false }

var _ grpclog.LoggerV2 = (*testLogger)(nil)

// startServer serves grpc-go's interop TestService on 127.0.0.1 until the
// test ends and returns its address.
func startServer(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(s, interop.NewTestServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = s.Serve(lis)
	}()
	t.Cleanup(func() {
		s.Stop()
		<-done
	})
	return lis.Addr().String()
}

// mode is one way of installing (or not) herdguard on the client.
type mode struct {
	name      string
	herdguard bool
	buffer    int  // herdguard's stream buffer; 0: the default
	tracing   bool // herdguard traces to a recording SDK provider
}

var (
	control        = mode{name: "control"}
	herdguardModes = []mode{
		{name: "herdguard/default-buffer/tracing-off", herdguard: true},
		{name: "herdguard/default-buffer/tracing-on", herdguard: true, tracing: true},
		{name: "herdguard/buffer-1/tracing-off", herdguard: true, buffer: 1},
		{name: "herdguard/buffer-1/tracing-on", herdguard: true, buffer: 1, tracing: true},
	}
	allModes = append([]mode{control}, herdguardModes...)
)

// dialOptions returns what a client in mode m dials with, the interceptor
// they install (nil in the control), and a check to run once the client's
// calls are done: with tracing on, that herdguard recorded client spans of
// the TestService's methods.
func (m mode) dialOptions(t *testing.T) (opts []grpc.DialOption, ic *interceptor.Interceptor, check func(t *testing.T)) {
	t.Helper()
	opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	check = func(*testing.T) {}
	if !m.herdguard {
		return opts, nil, check
	}
	var hg []interceptor.Option
	if m.buffer > 0 {
		hg = append(hg, interceptor.WithStreamBuffer(m.buffer))
	}
	if !m.tracing {
		hg = append(hg, interceptor.WithTracerProvider(noop.NewTracerProvider()))
	} else {
		rec := tracetest.NewSpanRecorder()
		tp := trace.NewTracerProvider(trace.WithSpanProcessor(rec))
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		hg = append(hg, interceptor.WithTracerProvider(tp))
		check = func(t *testing.T) {
			t.Helper()
			spans := rec.Ended()
			for _, s := range spans {
				if s.SpanKind() == oteltrace.SpanKindClient && strings.HasPrefix(s.Name(), "grpc.testing.") {
					return
				}
			}
			t.Errorf("herdguard recorded %d spans, none a client span of a grpc.testing method", len(spans))
		}
	}
	ic, err := interceptor.New(hg...)
	if err != nil {
		t.Fatalf("interceptor.New: %v", err)
	}
	return append(opts, ic.DialOptions()...), ic, check
}

// client is what an interop case runs against.
type client struct {
	addr string
	opts []grpc.DialOption // to dial more connections like cc
	cc   *grpc.ClientConn
	tc   testgrpc.TestServiceClient
}

func newClient(t *testing.T, addr string, opts []grpc.DialOption) client {
	t.Helper()
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return client{addr: addr, opts: opts, cc: cc, tc: testgrpc.NewTestServiceClient(cc)}
}

func soakConfig(addr string) interop.SoakTestConfig {
	return interop.SoakTestConfig{
		RequestSize:                      soakRequestSize,
		ResponseSize:                     soakResponseSize,
		PerIterationMaxAcceptableLatency: soakMaxLatency,
		OverallTimeout:                   soakOverall,
		ServerAddr:                       addr,
		NumWorkers:                       soakWorkers,
		Iterations:                       soakIterations,
		MaxFailures:                      0,
	}
}

// interopCases are the interop client's test cases, by their names there.
var interopCases = []struct {
	name string
	run  func(t *testing.T, ctx context.Context, c client)
}{
	{"empty_unary", func(_ *testing.T, ctx context.Context, c client) { interop.DoEmptyUnaryCall(ctx, c.tc) }},
	{"large_unary", func(_ *testing.T, ctx context.Context, c client) { interop.DoLargeUnaryCall(ctx, c.tc) }},
	{"client_streaming", func(_ *testing.T, ctx context.Context, c client) { interop.DoClientStreaming(ctx, c.tc) }},
	{"server_streaming", func(_ *testing.T, ctx context.Context, c client) { interop.DoServerStreaming(ctx, c.tc) }},
	{"ping_pong", func(_ *testing.T, ctx context.Context, c client) { interop.DoPingPong(ctx, c.tc) }},
	{"empty_stream", func(_ *testing.T, ctx context.Context, c client) { interop.DoEmptyStream(ctx, c.tc) }},
	{"cancel_after_begin", func(_ *testing.T, ctx context.Context, c client) { interop.DoCancelAfterBegin(ctx, c.tc) }},
	{"cancel_after_first_response", func(_ *testing.T, ctx context.Context, c client) { interop.DoCancelAfterFirstResponse(ctx, c.tc) }},
	{"timeout_on_sleeping_server", func(_ *testing.T, ctx context.Context, c client) { interop.DoTimeoutOnSleepingServer(ctx, c.tc) }},
	{"status_code_and_message", func(_ *testing.T, ctx context.Context, c client) { interop.DoStatusCodeAndMessage(ctx, c.tc) }},
	{"special_status_message", func(_ *testing.T, ctx context.Context, c client) { interop.DoSpecialStatusMessage(ctx, c.tc) }},
	{"custom_metadata", func(_ *testing.T, ctx context.Context, c client) { interop.DoCustomMetadata(ctx, c.tc) }},
	{"unimplemented_method", func(_ *testing.T, ctx context.Context, c client) { interop.DoUnimplementedMethod(ctx, c.cc) }},
	{"unimplemented_service", func(_ *testing.T, ctx context.Context, c client) {
		interop.DoUnimplementedService(ctx, testgrpc.NewUnimplementedServiceClient(c.cc))
	}},
	{"rpc_soak", func(_ *testing.T, ctx context.Context, c client) {
		cfg := soakConfig(c.addr)
		cfg.ChannelForTest = func() (*grpc.ClientConn, func()) { return c.cc, func() {} }
		interop.DoSoakTest(ctx, cfg)
	}},
	{"channel_soak", func(t *testing.T, ctx context.Context, c client) {
		// NewClient fails only on bad options or targets, the same each
		// time: try once here, where a failure can stop the test.
		probe, err := grpc.NewClient(c.addr, c.opts...)
		if err != nil {
			t.Fatalf("grpc.NewClient: %v", err)
		}
		_ = probe.Close()
		cfg := soakConfig(c.addr)
		cfg.ChannelForTest = func() (*grpc.ClientConn, func()) {
			cc, err := grpc.NewClient(c.addr, c.opts...)
			if err != nil {
				panic(fmt.Sprintf("grpc.NewClient failed after it succeeded with the same options: %v", err))
			}
			return cc, func() { _ = cc.Close() }
		}
		interop.DoSoakTest(ctx, cfg)
	}},
}

// TestInterop runs every interop case in every mode, each on a connection
// of its own through an interceptor of its own.
func TestInterop(t *testing.T) {
	addr := startServer(t)
	for _, m := range allModes {
		t.Run(m.name, func(t *testing.T) {
			for _, tc := range interopCases {
				t.Run(tc.name, func(t *testing.T) {
					logger.bind(t)
					opts, _, check := m.dialOptions(t)
					c := newClient(t, addr, opts)
					ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
					defer cancel()
					tc.run(t, ctx, c)
					check(t)
				})
			}
		})
	}
}

// TestTimeoutOnSleepingServerRepeated runs timeout_on_sleeping_server many
// times through herdguard, where a deadline of 1ms races the stream's
// setup, its send and its receive, and the race detector watches. Each run
// has a connection and an interceptor of its own, as in TestInterop: a
// deadline that passes while the server sleeps counts against the breaker,
// so through one interceptor the breaker would open after a few runs, as it
// should for a server that never answers in time.
func TestTimeoutOnSleepingServerRepeated(t *testing.T) {
	addr := startServer(t)
	for _, m := range herdguardModes {
		t.Run(m.name, func(t *testing.T) {
			logger.bind(t)
			ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
			defer cancel()
			for i := range sleepingServerRuns {
				opts, _, check := m.dialOptions(t)
				cc, err := grpc.NewClient(addr, opts...)
				if err != nil {
					t.Fatalf("grpc.NewClient: %v", err)
				}
				tc := testgrpc.NewTestServiceClient(cc)
				// connected first, so that the 1ms deadline meets the
				// stream rather than the dial
				interop.DoEmptyUnaryCall(ctx, tc)
				interop.DoTimeoutOnSleepingServer(ctx, tc)
				_ = cc.Close()
				if i == 0 {
					check(t)
				}
			}
		})
	}
}
