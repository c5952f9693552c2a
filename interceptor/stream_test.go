package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// attemptOf is the attempt number a server handler sees: 1 for a first
// attempt, else the herdguard-attempt metadata.
func attemptOf(ctx context.Context) int {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(wire.AttemptKey); len(v) > 0 {
		n, _ := strconv.Atoi(v[0])
		return n
	}
	return 1
}

func payload(s string) *testgrpc.Payload { return &testgrpc.Payload{Body: []byte(s)} }

func streamClient(t *testing.T, srv *testserver.Server, opts ...Option) (testgrpc.TestServiceClient, *Interceptor) {
	t.Helper()
	ic, err := New(append([]Option{withClock(newFakeClock()), withRand(fixedRand(0.5))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return srv.Client(t, ic.DialOptions()...), ic
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	t.Cleanup(cancel)
	return ctx
}

// recvAll reads a server stream to its end and returns the bodies.
func recvAll[T interface{ GetPayload() *testgrpc.Payload }](recv func() (T, error)) ([]string, error) {
	var got []string
	for {
		m, err := recv()
		if err == io.EOF {
			return got, nil
		}
		if err != nil {
			return got, err
		}
		got = append(got, string(m.GetPayload().GetBody()))
	}
}

func TestServerStreamRetriedAtOpen(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(req *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if attemptOf(ss.Context()) < 3 {
			return status.Error(codes.Unavailable, "warming up")
		}
		for i := range len(req.GetResponseParameters()) {
			if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(fmt.Sprint(i))}); err != nil {
				return err
			}
		}
		return nil
	}})
	c, _ := streamClient(t, srv)
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{ResponseParameters: make([]*testgrpc.ResponseParameters, 5)})
	if err != nil {
		t.Fatal(err)
	}
	got, err := recvAll(stream.Recv)
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	if want := []string{"0", "1", "2", "3", "4"}; !slices.Equal(got, want) {
		t.Errorf("received %q, want %q: every message once", got, want)
	}
	if got := srv.Attempts(); !slices.Equal(got, []string{"", "2", "3"}) {
		t.Errorf("server saw attempts %q", got)
	}
}

func TestServerStreamNotRetriedAfterAMessage(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("first")}); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "crashed mid-stream")
	}})
	c, _ := streamClient(t, srv)
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := recvAll(stream.Recv)
	if !slices.Equal(got, []string{"first"}) || status.Code(err) != codes.Unavailable {
		t.Errorf("got %q then %v; want the one message, then Unavailable", got, err)
	}
	var re *RetryError
	if errors.As(err, &re) {
		t.Errorf("a committed stream's error came wrapped: %v", err)
	}
	if n := srv.Requests(); n != 1 {
		t.Errorf("server saw %d attempts, want 1", n)
	}
}

// seen records what a client-stream handler read, per attempt.
type seen struct {
	mu  sync.Mutex
	got map[int][]string
}

func (s *seen) add(attempt int, body string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.got == nil {
		s.got = map[int][]string{}
	}
	s.got[attempt] = append(s.got[attempt], body)
}

func (s *seen) of(attempt int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.got[attempt]...)
}

func TestClientStreamReplayedAfterServerFailsBeforeAnswering(t *testing.T) {
	var rec seen
	srv := testserver.Start(t, &testserver.Server{ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		n := attemptOf(ss.Context())
		total := 0
		for {
			m, err := ss.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				return err
			}
			rec.add(n, string(m.GetPayload().GetBody()))
			total += len(m.GetPayload().GetBody())
		}
		if n == 1 {
			return status.Error(codes.Unavailable, "lost it all")
		}
		return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(total)})
	}})
	rec2 := &rec
	c, _ := streamClient(t, srv)
	stream, err := c.StreamingInputCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"a", "bb", "ccc", "dddd"}
	for _, b := range want {
		if err := stream.Send(&testgrpc.StreamingInputCallRequest{Payload: payload(b)}); err != nil {
			t.Fatalf("Send: %v", err)
		}
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		t.Fatalf("CloseAndRecv: %v", err)
	}
	if resp.GetAggregatedPayloadSize() != 10 {
		t.Errorf("aggregated size %d, want 10", resp.GetAggregatedPayloadSize())
	}
	if got := rec2.of(2); !slices.Equal(got, want) {
		t.Errorf("second attempt read %q, want %q exactly once, in order", got, want)
	}
	if got := rec2.of(1); !slices.Equal(got, want) {
		t.Errorf("first attempt read %q", got)
	}
}

func TestBidiReplayedBeforeFirstResponse(t *testing.T) {
	var rec seen
	srv := testserver.Start(t, &testserver.Server{Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
		n := attemptOf(ss.Context())
		for {
			m, err := ss.Recv()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
			body := string(m.GetPayload().GetBody())
			rec.add(n, body)
			if n == 1 {
				return status.Error(codes.Unavailable, "restarting")
			}
			if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("echo " + body)}); err != nil {
				return err
			}
		}
	}})
	c, _ := streamClient(t, srv)
	stream, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"x", "y", "z"} {
		if err := stream.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload(b)}); err != nil {
			t.Fatalf("Send(%s): %v", b, err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got, err := recvAll(stream.Recv)
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	if want := []string{"echo x", "echo y", "echo z"}; !slices.Equal(got, want) {
		t.Errorf("received %q, want %q", got, want)
	}
	if got := rec.of(2); !slices.Equal(got, []string{"x", "y", "z"}) {
		t.Errorf("second attempt read %q, want x y z once", got)
	}
}

func TestStreamBufferOverflowCommits(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		for {
			if _, err := ss.Recv(); err != nil {
				break
			}
		}
		return status.Error(codes.Unavailable, "down")
	}})
	rec, tp := newRecorder()
	for _, tt := range []struct {
		name    string
		opts    []Option
		call    []grpc.CallOption
		attempt int
	}{
		{"fits", nil, nil, 3},
		{"call option", nil, []grpc.CallOption{CallStreamBuffer(25)}, 1},
		{"interceptor option", []Option{WithStreamBuffer(25)}, nil, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec.Reset()
			n := srv.Requests()
			c, _ := streamClient(t, srv, append(tt.opts, WithTracerProvider(tp), WithoutBreaker())...)
			stream, err := c.StreamingInputCall(ctxT(t), tt.call...)
			if err != nil {
				t.Fatal(err)
			}
			// each message is 12 bytes encoded: the third outgrows 25
			for range 3 {
				stream.Send(&testgrpc.StreamingInputCallRequest{Payload: payload("12345678")})
			}
			if _, err := stream.CloseAndRecv(); status.Code(err) != codes.Unavailable {
				t.Fatalf("err = %v, want Unavailable", err)
			}
			if got := srv.Requests() - n; got != tt.attempt {
				t.Errorf("server saw %d attempts, want %d", got, tt.attempt)
			}
			cs := spansNamed(rec.Ended(), "grpc.testing.TestService/StreamingInputCall")
			if len(cs) != 1 {
				t.Fatalf("%d call spans", len(cs))
			}
			a := attrs(cs[0])
			overflow := tt.attempt == 1
			if a[names.AttrStreamOverflow].AsBool() != overflow || a[names.AttrStreamSent].AsInt64() != 3 {
				t.Errorf("overflow=%v sent=%d, want %v and 3", a[names.AttrStreamOverflow].AsBool(), a[names.AttrStreamSent].AsInt64(), overflow)
			}
			wantOutcome := OutcomeExhausted
			if overflow {
				wantOutcome = OutcomeFailedAfterCommit
			} else if got := a[names.AttrStreamReplayedMessages].AsInt64(); got != 6 {
				t.Errorf("replayed %d messages, want 6 (3 on each of 2 retries)", got)
			}
			if got := a[telemetry.AttrOutcome].AsString(); got != string(wantOutcome) {
				t.Errorf("outcome %q, want %q", got, wantOutcome)
			}
		})
	}
	if _, err := New(WithStreamBuffer(-1)); err == nil {
		t.Error("New accepted WithStreamBuffer(-1)")
	}
	c, _ := streamClient(t, srv)
	if _, err := c.StreamingInputCall(ctxT(t), CallStreamBuffer(-5)); status.Code(err) != codes.InvalidArgument {
		t.Errorf("CallStreamBuffer(-5): %v, want InvalidArgument", err)
	}
}

func TestStreamCancelDuringWait(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
		time.AfterFunc(20*ms, cancel)
		return status.Error(codes.Unavailable, "down")
	}})
	ic, _ := New(WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: 10 * time.Second, Multiplier: 1, Jitter: policy.NoJitter}))
	c := srv.Client(t, ic.DialOptions()...)
	start := time.Now()
	stream, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("returned after %v; want within milliseconds of the cancel", el)
	}
	if status.Code(err) != codes.Canceled {
		t.Errorf("err = %v, want Canceled", err)
	}
}

// A caller that cancelled its stream gets Canceled from RecvMsg, as gRPC's
// interop case cancel_after_begin asserts, even when the server's answer
// reached the client before the cancellation: gRPC's own stream may hand
// over either. The server answers at once; an empty call on the same
// connection, answered after it, makes sure the answer was read.
func TestCancelledStreamReceivesCanceled(t *testing.T) {
	answered := make(chan struct{}, 1)
	srv := testserver.Start(t, &testserver.Server{
		ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
			err := ss.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: 1})
			answered <- struct{}{}
			return err
		},
		Empty: func(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) { return &testgrpc.Empty{}, nil },
	})
	c, _ := streamClient(t, srv)
	for i := range 50 {
		ctx, cancel := context.WithCancel(ctxT(t))
		stream, err := c.StreamingInputCall(ctx)
		if err != nil {
			t.Fatal(err)
		}
		<-answered
		if _, err := c.EmptyCall(ctxT(t), &testgrpc.Empty{}); err != nil { // its answer follows the stream's
			t.Fatal(err)
		}
		cancel()
		if _, err := stream.CloseAndRecv(); status.Code(err) != codes.Canceled {
			t.Fatalf("run %d: CloseAndRecv after cancel = %v, want Canceled", i, err)
		}
	}
}

// A stream's per-attempt timeout runs on the interceptor's clock, as its
// backoff waits do: the attempt times out when the clock says its time
// has passed (here at once in real time), and the retry goes.
func TestStreamPerAttemptTimeoutRunsOnTheClock(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if attemptOf(ss.Context()) == 1 {
			<-ss.Context().Done() // say nothing until the attempt times out
			return nil
		}
		return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("ok")})
	}})
	clk := newManualClock() // waits are instant, timers fire when advanced
	c, _ := streamClient(t, srv, withClock(clk), WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: 2, PerAttemptTimeout: 2 * time.Second}))
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		got []string
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, err := recvAll(stream.Recv)
		done <- result{got, err}
	}()
	clk.waitArmed(t, 2*time.Second) // the attempt's timer, on the clock
	eventually(t, "the first attempt at the server", func() (int, bool) { n := srv.Requests(); return n, n == 1 })
	select {
	case r := <-done:
		t.Fatalf("the stream ended before its attempt's time passed on the clock: %q, %v", r.got, r.err)
	default:
	}
	clk.Advance(2 * time.Second)
	r := <-done
	if r.err != nil || !slices.Equal(r.got, []string{"ok"}) {
		t.Errorf("got %q, %v; want the second attempt's message", r.got, r.err)
	}
	if n := srv.Requests(); n != 2 {
		t.Errorf("server saw %d attempts, want 2", n)
	}
}

func TestStreamPerAttemptTimeoutOnlyUntilCommit(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if attemptOf(ss.Context()) == 1 {
			<-ss.Context().Done() // say nothing until the attempt times out
			return nil
		}
		ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("1")})
		time.Sleep(300 * ms) // longer than the per-attempt timeout, after commit
		return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("2")})
	}})
	c, _ := streamClient(t, srv, withClock(clock.Real()), // the per-attempt timeout in real time
		WithPolicy(policy.Policy{MaxAttempts: 3, PerAttemptTimeout: 100 * ms}))
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := recvAll(stream.Recv)
	if err != nil || !slices.Equal(got, []string{"1", "2"}) {
		t.Errorf("got %q, %v; want both messages: the timeout must stop at commit", got, err)
	}
	if n := srv.Requests(); n != 2 {
		t.Errorf("server saw %d attempts, want 2", n)
	}
}

func TestStreamBreaker(t *testing.T) {
	failing := true
	var mu sync.Mutex
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		mu.Lock()
		defer mu.Unlock()
		if failing {
			return status.Error(codes.Unavailable, "down")
		}
		return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("ok")})
	}, Unary: fail(codes.Unavailable).unary})
	// The breaker alone: with the overload controller, a server that
	// answered the probe and refuses again is an overload it paces.
	clk := newFakeClock()
	c, ic := streamClient(t, srv, withClock(clk), WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 50 * ms}), WithoutOverloadControl())
	open := func() ([]string, error) {
		stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			return nil, err
		}
		return recvAll(stream.Recv)
	}
	if _, err := open(); status.Code(err) != codes.Unavailable {
		t.Fatalf("first stream: %v", err)
	}
	b := ic.Breakers().Get(testserver.Target, "")
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after a failed stream: %v, want open (counted before Recv returns)", got)
	}
	n := srv.Requests()
	_, err := open()
	if !errors.Is(err, breaker.ErrOpen) || status.Code(err) != codes.Unavailable {
		t.Fatalf("stream through an open breaker: %v, want ErrOpen", err)
	}
	if srv.Requests() != n {
		t.Error("an open breaker let a stream attempt through")
	}

	passOpen(t, clk, b)
	if _, err := open(); status.Code(err) != codes.Unavailable {
		t.Fatalf("probe: %v", err)
	}
	if got := srv.Requests() - n; got != 1 {
		t.Errorf("a failing probe stream made %d attempts, want 1", got)
	}
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after a failed probe: %v, want open", got)
	}
	passOpen(t, clk, b)
	mu.Lock()
	failing = false
	mu.Unlock()
	if got, err := open(); err != nil || !slices.Equal(got, []string{"ok"}) {
		t.Fatalf("good probe: %q, %v", got, err)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("after a good probe: %v, want closed", got)
	}

	// unary calls and streams share the target's breaker
	call(t, c)
	if _, err := open(); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("after unary failures a stream got %v, want ErrOpen", err)
	}
}

func TestStreamSpanTree(t *testing.T) {
	rec, tp := newRecorder()
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if attemptOf(ss.Context()) == 1 {
			return status.Error(codes.Unavailable, "once")
		}
		ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("a")})
		return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("b")})
	}})
	c, _ := streamClient(t, srv, WithTracerProvider(tp), WithPolicy(tablePolicy))
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{Payload: payload("hello")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := recvAll(stream.Recv); err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	calls := spansNamed(spans, "grpc.testing.TestService/StreamingOutputCall")
	if len(calls) != 1 {
		t.Fatalf("%d call spans", len(calls))
	}
	a := attrs(calls[0])
	for k, want := range map[attribute.Key]any{
		telemetry.AttrAttempts: int64(2), telemetry.AttrOutcome: "ok", "rpc.response.status_code": "OK",
		names.AttrStreamSent: int64(1), names.AttrStreamReceived: int64(2),
		names.AttrStreamReplayedMessages: int64(1), names.AttrStreamOverflow: false,
	} {
		if got := a[k].AsInterface(); got != want {
			t.Errorf("call span %s = %v, want %v", k, got, want)
		}
	}
	if got, want := a[names.AttrStreamReplayedBytes].AsInt64(), int64(9); got != want {
		t.Errorf("replayed bytes %d, want %d (the request's encoded size)", got, want)
	}
	attempts, backoffs := spansNamed(spans, telemetry.SpanAttempt), spansNamed(spans, telemetry.SpanBackoff)
	if len(attempts) != 2 || len(backoffs) != 1 {
		t.Fatalf("%d attempts, %d backoffs; want 2 and 1", len(attempts), len(backoffs))
	}
	for _, s := range append(attempts, backoffs...) {
		if s.Parent().SpanID() != calls[0].SpanContext().SpanID() {
			t.Errorf("%s span is not a child of the stream's call span", s.Name())
		}
	}
	if got := attrs(attempts[0])["rpc.response.status_code"].AsString(); got != "UNAVAILABLE" {
		t.Errorf("first attempt status %q", got)
	}
	if got := attrs(backoffs[0])[names.AttrBackoffDelayMS].AsFloat64(); got != 10 {
		t.Errorf("backoff %v ms, want 10", got)
	}
}

func TestAbandonedStreamEndsItsSpan(t *testing.T) {
	rec, tp := newRecorder()
	release := make(chan struct{})
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("a")})
		select {
		case <-ss.Context().Done():
		case <-release:
		}
		return nil
	}})
	defer close(release)
	c, ic := streamClient(t, srv, WithTracerProvider(tp), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel() // abandon it without reading to the end
	deadline := time.Now().Add(callTimeout)
	for len(spansNamed(rec.Ended(), "grpc.testing.TestService/StreamingOutputCall")) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the call span of an abandoned stream never ended")
		}
		time.Sleep(ms)
	}
	cs := spansNamed(rec.Ended(), "grpc.testing.TestService/StreamingOutputCall")[0]
	if got := attrs(cs)[telemetry.AttrOutcome].AsString(); got != string(OutcomeCanceled) {
		t.Errorf("outcome %q, want canceled", got)
	}
	if got := ic.Breakers().Get(testserver.Target, "").State(); got != breaker.Closed {
		t.Errorf("abandoning a stream moved the breaker to %v", got)
	}
}

// TestEveryStreamKind runs the same two cases for each kind: a failure at
// open is retried and the caller sees every message once; a failure after
// the first response is not retried, and the caller sees that response and
// then the error.
func TestEveryStreamKind(t *testing.T) {
	type kind struct {
		name string
		// run opens the stream, sends "m1" and "m2" where the kind sends,
		// and reads every response body until the end.
		run func(c testgrpc.TestServiceClient, ctx context.Context) ([]string, error)
	}
	// behave is the server's part: fail at open on attempt 1, or answer
	// once and then fail.
	var failAfter atomic.Bool
	answer := func(ctx context.Context, send func(string) error) error {
		failAfterFirst := failAfter.Load()
		if !failAfterFirst && attemptOf(ctx) == 1 {
			return status.Error(codes.Unavailable, "not yet")
		}
		if err := send("r1"); err != nil {
			return err
		}
		if failAfterFirst {
			return status.Error(codes.Unavailable, "broke after r1")
		}
		return send("r2")
	}
	srv := testserver.Start(t, &testserver.Server{
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return answer(ss.Context(), func(b string) error {
				return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(b)})
			})
		},
		ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
			if !failAfter.Load() && attemptOf(ss.Context()) == 1 {
				return status.Error(codes.Unavailable, "not yet")
			}
			for {
				if _, err := ss.Recv(); err != nil {
					break
				}
			}
			return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: 1})
		},
		Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
			return answer(ss.Context(), func(b string) error {
				return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(b)})
			})
		},
	})
	kinds := []kind{
		{"server stream", func(c testgrpc.TestServiceClient, ctx context.Context) ([]string, error) {
			s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
			if err != nil {
				return nil, err
			}
			return recvAll(s.Recv)
		}},
		{"client stream", func(c testgrpc.TestServiceClient, ctx context.Context) ([]string, error) {
			s, err := c.StreamingInputCall(ctx)
			if err != nil {
				return nil, err
			}
			s.Send(&testgrpc.StreamingInputCallRequest{Payload: payload("m1")})
			s.Send(&testgrpc.StreamingInputCallRequest{Payload: payload("m2")})
			resp, err := s.CloseAndRecv()
			if err != nil {
				return nil, err
			}
			return []string{fmt.Sprint(resp.GetAggregatedPayloadSize())}, nil
		}},
		{"bidi stream", func(c testgrpc.TestServiceClient, ctx context.Context) ([]string, error) {
			s, err := c.FullDuplexCall(ctx)
			if err != nil {
				return nil, err
			}
			s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("m1")})
			s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("m2")})
			s.CloseSend()
			return recvAll(s.Recv)
		}},
	}
	c, _ := streamClient(t, srv)
	for _, k := range kinds {
		t.Run(k.name+"/failure at open", func(t *testing.T) {
			failAfter.Store(false)
			n := srv.Requests()
			got, err := k.run(c, ctxT(t))
			want := []string{"r1", "r2"}
			if k.name == "client stream" {
				want = []string{"1"}
			}
			if err != nil || !slices.Equal(got, want) {
				t.Errorf("got %q, %v; want %q once", got, err, want)
			}
			if d := srv.Requests() - n; d != 2 {
				t.Errorf("server saw %d attempts, want 2", d)
			}
		})
		if k.name == "client stream" {
			continue // its one response ends it: there is no "after"
		}
		t.Run(k.name+"/failure after first response", func(t *testing.T) {
			failAfter.Store(true)
			n := srv.Requests()
			got, err := k.run(c, ctxT(t))
			if !slices.Equal(got, []string{"r1"}) || status.Code(err) != codes.Unavailable {
				t.Errorf("got %q, %v; want r1, then Unavailable", got, err)
			}
			if d := srv.Requests() - n; d != 1 {
				t.Errorf("server saw %d attempts, want 1: a committed stream is never retried", d)
			}
		})
	}
}

func TestHeaderCommitsTheStream(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		ss.SendHeader(metadata.Pairs("served-by", fmt.Sprint(attemptOf(ss.Context()))))
		time.Sleep(20 * ms) // let the client read the header first
		return status.Error(codes.Unavailable, "after headers")
	}})
	c, _ := streamClient(t, srv)
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	md, err := stream.Header()
	if err != nil || md.Get("served-by")[0] != "1" {
		t.Fatalf("Header = %v, %v", md, err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("Recv after headers: %v, want Unavailable, not retried", err)
	}
	if n := srv.Requests(); n != 1 {
		t.Errorf("server saw %d attempts, want 1", n)
	}
	if stream.Context() == nil {
		t.Error("Context() of the committed attempt is nil")
	}
}

func TestStreamBreakerEvents(t *testing.T) {
	rec, tp := newRecorder()
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
		return status.Error(codes.Unavailable, "down")
	}})
	c, _ := streamClient(t, srv, WithTracerProvider(tp), WithPolicy(policy.Policy{MaxAttempts: 1}),
		WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	for range 2 { // the first trips the breaker, the second is refused
		if s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{}); err == nil {
			s.Recv()
		}
	}
	cs := spansNamed(rec.Ended(), "grpc.testing.TestService/StreamingOutputCall")
	if len(cs) != 2 {
		t.Fatalf("%d call spans, want 2", len(cs))
	}
	if ev := cs[0].Events(); len(ev) != 1 || ev[0].Name != names.EventBreakerStateChange {
		t.Errorf("tripping stream's events %v, want one %s", ev, names.EventBreakerStateChange)
	} else {
		got := map[attribute.Key]string{}
		for _, kv := range ev[0].Attributes {
			got[kv.Key] = kv.Value.AsString()
		}
		if got[telemetry.AttrBreakerFrom] != "closed" || got[telemetry.AttrBreakerTo] != "open" {
			t.Errorf("state change %v, want closed -> open", got)
		}
	}
	if ev := cs[1].Events(); len(ev) != 1 || ev[0].Name != names.EventBreakerRejected {
		t.Errorf("refused stream's events %v, want one %s", ev, names.EventBreakerRejected)
	}
}

// TestReplayBufferAllocations: keeping a client stream's messages for replay
// costs at most one allocation per message (the buffer grows by doubling,
// so far fewer), and a stream's one small request costs none.
func TestReplayBufferAllocations(t *testing.T) {
	m := &testgrpc.StreamingInputCallRequest{Payload: payload("0123456789")}
	for _, n := range []int{1, 100} {
		allocs := testing.AllocsPerRun(50, func() {
			s := &clientStream{limit: defaultStreamBuffer}
			kept := 0
			for range n {
				if s.bufferLocked(m) {
					kept++
				}
			}
			if s.replay.len() != n || kept != n {
				t.Fatalf("kept %d of %d messages (%d said kept)", s.replay.len(), n, kept)
			}
		}) - 1 // the stream itself
		if max := float64(n) / 4; n == 1 && allocs > 0 || allocs > max {
			t.Errorf("%d messages kept with %v allocations, want %s", n, allocs, map[bool]string{true: "none", false: fmt.Sprintf("at most %v", max)}[n == 1])
		}
	}
}

// TestStreamStateMovesForward: a stream's state only moves forward. It
// commits only while open; ending moves an open stream to ended and a
// committed one to done; an ended stream never commits after, so that
// every operation on it reports its final status.
func TestStreamStateMovesForward(t *testing.T) {
	for _, tc := range []struct {
		from            streamState
		commit          streamState // after commitLocked
		end             streamState // after ending
		open, committed bool
		ended           bool
	}{
		{streamOpen, streamCommitted, streamEnded, true, false, false},
		{streamCommitted, streamCommitted, streamDone, false, true, false},
		{streamEnded, streamEnded, streamEnded, false, false, true},
		{streamDone, streamDone, streamDone, false, true, true},
	} {
		if tc.from.isOpen() != tc.open || tc.from.isCommitted() != tc.committed || tc.from.isEnded() != tc.ended {
			t.Errorf("state %d: open %v committed %v ended %v, want %v %v %v", tc.from,
				tc.from.isOpen(), tc.from.isCommitted(), tc.from.isEnded(), tc.open, tc.committed, tc.ended)
		}
		s := &clientStream{state: tc.from, a: &streamAttempt{}}
		s.commitLocked(false)
		if s.state != tc.commit {
			t.Errorf("state %d: commit moved it to %d, want %d", tc.from, s.state, tc.commit)
		}
		if got := tc.from.end(); got != tc.end && !tc.ended {
			t.Errorf("state %d: end moved it to %d, want %d", tc.from, got, tc.end)
		}
	}
}
