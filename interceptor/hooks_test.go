package interceptor

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/policy"
)

// recorded collects what the hooks were told, as lines.
type recorded struct {
	mu    sync.Mutex
	lines []string
}

func (r *recorded) add(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, fmt.Sprintf(format, args...))
}

func (r *recorded) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	l := r.lines
	r.lines = nil
	return l
}

func (r *recorded) hooks() Hooks {
	return Hooks{
		OnRetry: func(_ context.Context, e RetryEvent) {
			r.add("retry %s attempt %d %v wait %v %s", e.Method, e.Attempt, status.Code(e.Err), e.Wait, e.Reason)
		},
		OnGiveUp: func(_ context.Context, e GiveUpEvent) {
			r.add("give up %s %s after %d: %v", e.Method, e.Outcome, e.Attempts, status.Code(e.Err))
		},
		OnHeld: func(_ context.Context, e HeldEvent) {
			r.add("held attempt %d for %v shed %v", e.Attempt, e.Held, e.Shed)
		},
		OnBreakerChange: func(_ context.Context, e BreakerEvent) {
			r.add("breaker %s %v->%v after %d failures in a row", e.Scope, e.From, e.To, e.Counts.ConsecutiveFailures)
		},
	}
}

// Each hook is called when its thing happens, and only then: a retry
// scheduled (with its wait and why), a call that failed (once, with its
// outcome and attempts), a breaker's transition (with its counts); a call
// that succeeds at once tells nothing.
func TestHooks(t *testing.T) {
	var r recorded
	sc := fail(codes.Unavailable, codes.Unavailable, codes.OK, codes.NotFound, codes.Unavailable)
	sc.trailers = map[int]metadata.MD{1: {wire.PushbackKey: {"70"}}}
	_, c, _, ic := setup(t, sc, WithHooks(r.hooks()), WithoutOverloadControl(), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}),
		WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Jitter: policy.NoJitter}))
	m := testserver.MethodUnary
	if err := call(t, c); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"retry " + m + " attempt 1 Unavailable wait 10ms backoff",
		"retry " + m + " attempt 2 Unavailable wait 70ms pushback",
	}
	if got := r.take(); !slices.Equal(got, want) {
		t.Errorf("a call that succeeded on its third attempt told\n%q\nwant\n%q", got, want)
	}
	call(t, c) // NotFound: not retried, and an answer for the breaker
	if got, want := r.take(), []string{"give up " + m + " not_retryable after 1: NotFound"}; !slices.Equal(got, want) {
		t.Errorf("a call not retried told %q, want %q", got, want)
	}
	call(t, c) // Unavailable three times: exhausted, and the breaker opens
	call(t, c) // refused
	want = []string{
		"retry " + m + " attempt 1 Unavailable wait 10ms backoff",
		"retry " + m + " attempt 2 Unavailable wait 20ms backoff",
		"breaker " + testserver.Target + " closed->open after 1 failures in a row",
		"give up " + m + " exhausted after 3: Unavailable",
		"give up " + m + " breaker_open after 0: Unavailable",
	}
	if got := r.take(); !slices.Equal(got, want) {
		t.Errorf("a call out of attempts, then one refused, told\n%q\nwant\n%q", got, want)
	}
	if ic.Breakers().Get(testserver.Target, m).State() != breaker.Open {
		t.Error("breaker not open after the event said so")
	}
}

// A stream that fails tells OnGiveUp once, with its attempts.
func TestHooksStream(t *testing.T) {
	var r recorded
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
		return status.Error(codes.Unavailable, "down")
	}})
	ic, err := New(withClock(newFakeClock()), WithHooks(r.hooks()), WithoutBreaker(), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, Jitter: policy.NoJitter}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	s, err := srv.Client(t, ic.DialOptions()...).StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err == nil {
		_, err = s.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Recv: %v, want Unavailable", err)
	}
	m := "/grpc.testing.TestService/StreamingOutputCall"
	want := []string{"retry " + m + " attempt 1 Unavailable wait 10ms backoff", "give up " + m + " exhausted after 2: Unavailable"}
	if got := r.take(); !slices.Equal(got, want) {
		t.Errorf("a stream out of attempts told\n%q\nwant\n%q", got, want)
	}
}

// A hook that panics is recovered and reported, through the logger here:
// the call goes on, and its answer reaches the caller.
func TestHookPanicIsRecovered(t *testing.T) {
	logs := &logRecorder{}
	sc := fail(codes.Unavailable, codes.OK)
	_, c, _, _ := setup(t, sc, WithoutOverloadControl(), WithLogger(slog.New(logs)),
		WithHooks(Hooks{OnRetry: func(context.Context, RetryEvent) { panic("a bug in the caller's hook") }}))
	if err := call(t, c); err != nil {
		t.Fatalf("call: %v, want the retry's answer despite the hook", err)
	}
	if !slices.ContainsFunc(logs.records(), func(s string) bool {
		return strings.HasPrefix(s, "ERROR herdguard: interceptor: hook OnRetry panicked: a bug in the caller's hook")
	}) {
		t.Errorf("logged %q, want the panic reported at ERROR", logs.records())
	}
}

// WithLogger logs retries at Debug, a call herdguard gave up on and a
// breaker that opens at Warn, with the method, the target, the attempt and
// the code as attributes; other failures at Info.
func TestLogger(t *testing.T) {
	logs := &logRecorder{}
	sc := fail(codes.Unavailable, codes.Unavailable, codes.NotFound)
	_, c, _, _ := setup(t, sc, WithoutOverloadControl(), WithLogger(slog.New(logs)), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}),
		WithPolicy(policy.Policy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, Jitter: policy.NoJitter}))
	call(t, c) // exhausted: the breaker opens
	m := strings.TrimPrefix(testserver.MethodUnary, "")
	want := []string{
		"DEBUG herdguard: retrying rpc.method=" + m + " herdguard.target=" + testserver.Target + " herdguard.attempt=1 rpc.response.status_code=UNAVAILABLE wait=10ms reason=backoff",
		"WARN herdguard: circuit breaker open herdguard.breaker.scope=" + testserver.Target + " herdguard.breaker.from=closed herdguard.breaker.to=open consecutive_failures=1 failures=1 successes=0",
		"WARN herdguard: call failed rpc.method=" + m + " herdguard.target=" + testserver.Target + " herdguard.outcome=exhausted herdguard.attempts=2 rpc.response.status_code=UNAVAILABLE",
	}
	got := logs.records()
	for i := range got {
		got[i], _, _ = strings.Cut(got[i], " error=") // the message of the status, with herdguard's wording
	}
	if !slices.Equal(got, want) {
		t.Errorf("logged\n%q\nwant\n%q", got, want)
	}
}

// logRecorder is a slog.Handler that keeps every record, at every level,
// as "LEVEL message key=value ...".
type logRecorder struct {
	mu   sync.Mutex
	recs []string
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Level.String() + " " + r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.Key + "=" + a.Value.String())
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, b.String())
	return nil
}

func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecorder) WithGroup(string) slog.Handler      { return h }

func (h *logRecorder) records() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.recs)
}
