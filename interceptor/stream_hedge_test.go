package interceptor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"

	"github.com/herdguard/herdguard/internal/testutil"
)

// streamScript plays a stream handler per attempt: the test says what each
// attempt does; arrivals are announced, and how each attempt's context
// ended is kept.
type streamScript struct {
	arrived arrivals
	mu      sync.Mutex
	do      map[int]func(ss grpc.ServerStream) error
	read    map[int][]string // what a client-stream or bidi attempt read
	ended   map[int]error
}

func newStreamScript() *streamScript {
	return &streamScript{arrived: make(arrivals, 16), do: map[int]func(grpc.ServerStream) error{},
		read: map[int][]string{}, ended: map[int]error{}}
}

func (s *streamScript) on(n int, f func(ss grpc.ServerStream) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.do[n] = f
}

func (s *streamScript) serve(ss grpc.ServerStream) error {
	n := attemptOf(ss.Context())
	s.mu.Lock()
	f := s.do[n]
	s.mu.Unlock()
	s.arrived <- n
	if f == nil {
		<-ss.Context().Done() // hang until cancelled
		s.mu.Lock()
		s.ended[n] = ss.Context().Err()
		s.mu.Unlock()
		return ss.Context().Err()
	}
	return f(ss)
}

func (s *streamScript) wait(t *testing.T, want int) {
	t.Helper()
	s.arrived.wait(t, want)
}

// hedgeAtDelay moves the clock to the hedging delay and checks that the
// hedge, attempt 2, goes then and not a nanosecond before.
func (s *streamScript) hedgeAtDelay(t *testing.T, clk *manualClock) {
	t.Helper()
	clk.Advance(hedgeDelay - time.Nanosecond)
	s.none(t)
	clk.Advance(time.Nanosecond)
	s.wait(t, 2)
}

func (s *streamScript) none(t *testing.T) {
	t.Helper()
	s.arrived.none(t)
}

func (s *streamScript) endedWith(t *testing.T, n int) error {
	t.Helper()
	return endedAt(t, &s.mu, s.ended, n)
}

// readAll reads a client stream or bidi to its end, keeping the bodies.
func (s *streamScript) readAll(ss grpc.ServerStream, n int, m func() interface{ GetPayload() *testgrpc.Payload }) error {
	for {
		msg := m()
		if err := ss.RecvMsg(msg); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		s.mu.Lock()
		s.read[n] = append(s.read[n], string(msg.GetPayload().GetBody()))
		s.mu.Unlock()
	}
}

func (s *streamScript) readOf(n int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.read[n])
}

func sendWords(words ...string) func(ss grpc.ServerStream) error {
	return func(ss grpc.ServerStream) error {
		for _, w := range words {
			if err := ss.SendMsg(&testgrpc.StreamingOutputCallResponse{Payload: payload(w)}); err != nil {
				return err
			}
		}
		return nil
	}
}

func startStreamScript(t *testing.T, sc *streamScript) *testserver.Server {
	return testserver.Start(t, &testserver.Server{
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return sc.serve(ss)
		},
		ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error { return sc.serve(ss) },
		Bidi:         func(ss testgrpc.TestService_FullDuplexCallServer) error { return sc.serve(ss) },
	})
}

func hedgedStreamClient(t *testing.T, srv *testserver.Server, clk *manualClock, p policy.Policy, opts ...Option) testgrpc.TestServiceClient {
	t.Helper()
	ic, err := New(append([]Option{withClock(clk), WithPolicy(p)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return srv.Client(t, ic.DialOptions()...)
}

// TestHedgedServerStream: the first attempt hangs without an answer; after
// the delay a hedge answers and wins. The caller receives the hedge's
// messages, each once, and the first attempt is cancelled.
func TestHedgedServerStream(t *testing.T) {
	sc := newStreamScript()
	sc.on(2, sendWords("a", "b", "c"))
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(3))
	s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	got := make(chan []string, 1)
	go func() { // the caller's Recv waits while no attempt has answered
		words, err := recvAll(s.Recv)
		if err != nil {
			t.Errorf("Recv: %v", err)
		}
		got <- words
	}()
	sc.none(t)
	sc.hedgeAtDelay(t, clk)
	if words := <-got; !slices.Equal(words, []string{"a", "b", "c"}) {
		t.Errorf("received %q, want the hedge's a, b, c once each", words)
	}
	if err := sc.endedWith(t, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("the first attempt ended with %v, want cancelled", err)
	}
	clk.Advance(time.Hour)
	sc.none(t) // no hedge after the commit
}

// TestHedgedClientStreamGetsEveryMessage: messages sent before a hedge are
// replayed to it; those sent after go to every attempt in flight; the
// winner read them all once, in order.
func TestHedgedClientStreamGetsEveryMessage(t *testing.T) {
	sc := newStreamScript()
	words := []string{"one", "two", "three", "four"}
	for n := 1; n <= 2; n++ {
		sc.on(n, func(ss grpc.ServerStream) error {
			if err := sc.readAll(ss, n, func() interface{ GetPayload() *testgrpc.Payload } { return new(testgrpc.StreamingInputCallRequest) }); err != nil {
				return err
			}
			if n == 1 {
				<-ss.Context().Done() // the first never answers
				return ss.Context().Err()
			}
			return ss.SendMsg(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(len(sc.readOf(n)))})
		})
	}
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2))
	s, err := c.StreamingInputCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	for _, w := range words[:2] {
		if err := s.Send(&testgrpc.StreamingInputCallRequest{Payload: payload(w)}); err != nil {
			t.Fatal(err)
		}
	}
	sc.hedgeAtDelay(t, clk)
	for _, w := range words[2:] {
		if err := s.Send(&testgrpc.StreamingInputCallRequest{Payload: payload(w)}); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := s.CloseAndRecv()
	if err != nil || resp.GetAggregatedPayloadSize() != 4 {
		t.Fatalf("CloseAndRecv = %v, %v; want the hedge's answer of 4 messages", resp, err)
	}
	if got := sc.readOf(2); !slices.Equal(got, words) {
		t.Errorf("the hedge read %q, want %q once each, in order", got, words)
	}
	// the first attempt was cancelled once the hedge answered: what it had
	// read by then came in order, each once
	if got := sc.readOf(1); len(got) > len(words) || !slices.Equal(got, words[:len(got)]) {
		t.Errorf("the first attempt read %q, want a prefix of %q", got, words)
	}
}

func TestHedgedStreamNonFatalAndFatal(t *testing.T) {
	t.Run("non-fatal sends the next at once", func(t *testing.T) {
		sc := newStreamScript()
		sc.on(1, func(grpc.ServerStream) error { return status.Error(codes.Unavailable, "down") })
		sc.on(2, sendWords("x"))
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(3, codes.Unavailable))
		s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sc.wait(t, 1)
		sc.wait(t, 2) // the clock never moved
		if words, err := recvAll(s.Recv); err != nil || !slices.Equal(words, []string{"x"}) {
			t.Errorf("received %q, %v; want x", words, err)
		}
	})
	t.Run("fatal ends the stream", func(t *testing.T) {
		sc := newStreamScript()
		sc.on(2, func(grpc.ServerStream) error { return status.Error(codes.PermissionDenied, "no") })
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(3, codes.Unavailable))
		s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sc.wait(t, 1)
		clk.Advance(hedgeDelay)
		sc.wait(t, 2)
		_, err = s.Recv()
		var re *RetryError
		if status.Code(err) != codes.PermissionDenied || errors.As(err, &re) {
			t.Errorf("Recv: %v; want the hedge's PermissionDenied as it is", err)
		}
		if err := sc.endedWith(t, 1); !errors.Is(err, context.Canceled) {
			t.Errorf("the first attempt ended with %v, want cancelled", err)
		}
		clk.Advance(time.Hour)
		sc.none(t)
	})
	t.Run("the last allowed attempt pushed back", func(t *testing.T) {
		// A pushback delays the next hedge; when none may follow, the
		// stream ends with the last failure at once instead of waiting
		// for a timer that was never armed.
		sc := newStreamScript()
		for n := 1; n <= 2; n++ {
			sc.on(n, func(ss grpc.ServerStream) error {
				ss.SetTrailer(metadata.Pairs(wire.PushbackKey, "10"))
				return status.Error(codes.Unavailable, fmt.Sprint("down ", n))
			})
		}
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(2, codes.Unavailable))
		s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sc.wait(t, 1)
		clk.waitArmed(t, 10*time.Millisecond)
		clk.Advance(10 * time.Millisecond)
		sc.wait(t, 2)
		_, err = s.Recv() // ctxT's deadline fails the test if this hangs
		var re *RetryError
		if !errors.As(err, &re) || re.Outcome != OutcomeExhausted || re.Attempts != 2 || status.Convert(err).Message() != "down 2" {
			t.Errorf("Recv: %v; want an exhausted RetryError with the second attempt's Unavailable", err)
		}
	})
	t.Run("all non-fatal", func(t *testing.T) {
		sc := newStreamScript()
		for n := 1; n <= 3; n++ {
			sc.on(n, func(grpc.ServerStream) error { return status.Error(codes.Unavailable, fmt.Sprint("down ", n)) })
		}
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(3, codes.Unavailable))
		s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err == nil {
			_, err = s.Recv()
		}
		var re *RetryError
		if !errors.As(err, &re) || re.Outcome != OutcomeExhausted || re.Attempts != 3 || status.Code(err) != codes.Unavailable {
			t.Errorf("got %v; want an exhausted RetryError after 3 attempts", err)
		}
	})
}

// TestHedgedStreamOverflowCommitsToTheOldest: once the replay buffer
// overflows, the stream commits to its oldest attempt in flight, the
// others are cancelled, and no hedge starts.
func TestHedgedStreamOverflowCommitsToTheOldest(t *testing.T) {
	sc := newStreamScript()
	for n := 1; n <= 2; n++ {
		sc.on(n, func(ss grpc.ServerStream) error {
			if err := sc.readAll(ss, n, func() interface{ GetPayload() *testgrpc.Payload } { return new(testgrpc.StreamingOutputCallRequest) }); err != nil {
				return err
			}
			return ss.SendMsg(&testgrpc.StreamingOutputCallResponse{Payload: payload(fmt.Sprint("from ", n))})
		})
	}
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(3), WithStreamBuffer(16))
	s, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	sc.hedgeAtDelay(t, clk)
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("small")}); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("far too large to keep")}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Hour)
	sc.none(t) // no third attempt after the overflow
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	words, err := recvAll(s.Recv)
	if err != nil || !slices.Equal(words, []string{"from 1"}) {
		t.Errorf("received %q, %v; want the oldest attempt's answer", words, err)
	}
	if got := sc.readOf(1); !slices.Equal(got, []string{"small", "far too large to keep"}) {
		t.Errorf("the oldest attempt read %q, want both messages", got)
	}
}

// TestHedgedStreamHeader: Header waits for the winner and returns its
// headers.
func TestHedgedStreamHeader(t *testing.T) {
	sc := newStreamScript()
	sc.on(2, func(ss grpc.ServerStream) error {
		if err := ss.SendHeader(metadata.Pairs("who", "hedge")); err != nil {
			return err
		}
		return sendWords("h")(ss)
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2))
	s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	clk.Advance(hedgeDelay)
	md, err := s.Header()
	if err != nil || !slices.Equal(md.Get("who"), []string{"hedge"}) {
		t.Fatalf("Header = %v, %v; want the hedge's", md, err)
	}
	if words, err := recvAll(s.Recv); err != nil || !slices.Equal(words, []string{"h"}) {
		t.Errorf("received %q, %v", words, err)
	}
}

// TestHedgedStreamCallerCancel: a cancelled caller ends every attempt.
func TestHedgedStreamCallerCancel(t *testing.T) {
	sc := newStreamScript()
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(3))
	ctx, cancel := context.WithCancel(ctxT(t))
	s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	sc.hedgeAtDelay(t, clk)
	cancel()
	if _, err := s.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv: %v, want Canceled", err)
	}
	for n := 1; n <= 2; n++ {
		if err := sc.endedWith(t, n); !errors.Is(err, context.Canceled) {
			t.Errorf("attempt %d ended with %v, want cancelled", n, err)
		}
	}
}

// TestHedgedBidiStream: a hedge of a bidi stream is sent what the caller
// sent before it started, then every later message with the first attempt;
// the hedge answers first and the caller reads its replies only.
func TestHedgedBidiStream(t *testing.T) {
	sc := newStreamScript()
	sc.on(2, func(ss grpc.ServerStream) error {
		if err := sc.readAll(ss, 2, func() interface{ GetPayload() *testgrpc.Payload } { return new(testgrpc.StreamingOutputCallRequest) }); err != nil {
			return err
		}
		for _, w := range sc.readOf(2) {
			if err := ss.SendMsg(&testgrpc.StreamingOutputCallResponse{Payload: payload("echo " + w)}); err != nil {
				return err
			}
		}
		return nil
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2))
	s, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("a")}); err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	sc.hedgeAtDelay(t, clk)
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("b")}); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if words, err := recvAll(s.Recv); err != nil || !slices.Equal(words, []string{"echo a", "echo b"}) {
		t.Errorf("received %q, %v; want the hedge's echo of a and b", words, err)
	}
	if got := sc.readOf(2); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("the hedge read %q, want a replayed, then b", got)
	}
	if err := sc.endedWith(t, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("the first attempt ended with %v, want cancelled", err)
	}
}

// TestHedgedStreamGates: a stream's hedge is refused, as a unary call's is,
// while the breaker has seen a failure since its last success, and once
// the target's hedge budget is spent.
func TestHedgedStreamGates(t *testing.T) {
	open := func(t *testing.T, c testgrpc.TestServiceClient) (testgrpc.TestService_StreamingOutputCallClient, context.CancelFunc) {
		t.Helper()
		ctx, cancel := context.WithCancel(ctxT(t))
		s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return s, cancel
	}
	t.Run("breaker", func(t *testing.T) {
		sc := newStreamScript()
		sc.on(1, func(grpc.ServerStream) error { return status.Error(codes.Unavailable, "down") })
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(2)) // with the default breaker
		s, cancel := open(t, c)
		if _, err := s.Recv(); status.Code(err) != codes.Unavailable {
			t.Fatalf("first stream: %v, want its fatal Unavailable", err)
		}
		cancel()
		sc.wait(t, 1)
		sc.on(1, nil) // the next first attempt hangs
		s, cancel = open(t, c)
		defer cancel()
		sc.wait(t, 1)
		clk.Advance(hedgeDelay)
		sc.none(t) // the failure on the breaker's run refuses the hedge
		cancel()
		if _, err := s.Recv(); status.Code(err) != codes.Canceled {
			t.Errorf("Recv after cancel: %v", err)
		}
	})
	t.Run("hedge budget", func(t *testing.T) {
		sc := newStreamScript()
		srv, clk := startStreamScript(t, sc), newManualClock()
		// 0.1/s over 10s: one hedge in reserve; no answer earns another.
		c := hedgedStreamClient(t, srv, clk, hedging(2), WithoutBreaker(), WithHedgeBudget(policy.Budget{MinPerSecond: 0.1}))
		for i, want := range []bool{true, false} {
			_, cancel := open(t, c)
			sc.wait(t, 1)
			clk.Advance(hedgeDelay)
			if want {
				sc.wait(t, 2)
			} else {
				sc.none(t)
			}
			cancel()
			if err := sc.endedWith(t, 1); err == nil {
				t.Errorf("stream %d: its first attempt was not cancelled", i)
			}
			sc.mu.Lock()
			delete(sc.ended, 1)
			sc.mu.Unlock()
		}
	})
}

// TestHedgeOpeningHoldsUpNoAnswer: a hedge that cannot open yet (the server
// allows one stream at a time on the connection) does not hold up the first
// attempt's answer, and is given up once that answer wins.
func TestHedgeOpeningHoldsUpNoAnswer(t *testing.T) {
	sc := newStreamScript()
	release := make(chan struct{})
	sc.on(1, func(ss grpc.ServerStream) error {
		<-release // it answers after the hedging delay
		for {
			m := new(testgrpc.StreamingOutputCallRequest)
			if err := ss.RecvMsg(m); err != nil {
				return nil
			}
			if err := ss.SendMsg(&testgrpc.StreamingOutputCallResponse{Payload: m.GetPayload()}); err != nil {
				return err
			}
		}
	})
	srv := testserver.Start(t, &testserver.Server{
		Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error { return sc.serve(ss) },
	}, grpc.MaxConcurrentStreams(1))
	clk := newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2))
	s, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("x")}); err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	clk.Advance(hedgeDelay) // the hedge waits for a free stream
	close(release)
	got := make(chan error, 1)
	go func() {
		r, err := s.Recv()
		if err == nil && string(r.GetPayload().GetBody()) != "x" {
			err = fmt.Errorf("received %q, want x", r.GetPayload().GetBody())
		}
		got <- err
	}()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
	case <-time.After(callTimeout):
		t.Fatal("the first attempt answered, but Recv waited on the hedge that could not open")
	}
	// The answer gave the hedge up, and cancelled its opening. gRPC sees
	// that when its transport next runs the goroutine that waits for a
	// free stream: if the first stream ends before (it would free one),
	// gRPC picks either at random and may open the cancelled hedge all
	// the same. Wait for gRPC to have given it up before ending the
	// first: without that, attempt 2 reached the server in about 1 run
	// in 150 under -race.
	waitNoGoroutine(t, "interceptor.(*streamHedging).openHedge")
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Errorf("Recv at the end: %v, want io.EOF", err)
	}
	sc.none(t) // the hedge never reached the server
}

// waitNoGoroutine waits until no goroutine runs fn (a function's name as a
// stack trace prints it).
func waitNoGoroutine(t *testing.T, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	testutil.Eventually(t, "no goroutine running "+fn, func() bool {
		n := runtime.Stack(buf, true)
		return !bytes.Contains(buf[:n], []byte(fn))
	})
}

// TestHedgedStreamContextCommits: Context commits a hedged stream as gRPC
// commits its current attempt. While an attempt is in flight, to it: no
// hedge starts after, and the context stays alive with the stream. With
// every attempt failed and the next waiting for a pushback, to the failed
// one: the stream ends with its status, as gRPC's would, and no hedge
// starts.
func TestHedgedStreamContextCommits(t *testing.T) {
	t.Run("an attempt in flight", func(t *testing.T) {
		sc := newStreamScript()
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(3))
		ctx, cancel := context.WithCancel(ctxT(t))
		defer cancel()
		s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sc.wait(t, 1)
		sctx := s.Context()
		clk.Advance(time.Hour)
		sc.none(t)
		if sctx.Err() != nil {
			t.Errorf("the committed stream's context ended: %v", sctx.Err())
		}
		cancel()
		<-sctx.Done()
	})
	t.Run("waiting for a pushback", func(t *testing.T) {
		sc := newStreamScript()
		sc.on(1, func(ss grpc.ServerStream) error {
			ss.SetTrailer(metadata.Pairs(wire.PushbackKey, "1000"))
			return status.Error(codes.Unavailable, "down")
		})
		sc.on(2, sendWords("x"))
		srv, clk := startStreamScript(t, sc), newManualClock()
		c := hedgedStreamClient(t, srv, clk, hedging(3, codes.Unavailable))
		s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sc.wait(t, 1)
		clk.waitArmed(t, time.Second) // the pushback's wait
		if ctx := s.Context(); ctx.Err() == nil {
			t.Error("Context of a stream whose every attempt failed is alive; want its failed attempt's")
		}
		clk.Advance(time.Second)
		sc.none(t)
		if _, err := s.Recv(); status.Code(err) != codes.Unavailable {
			t.Errorf("Recv: %v, want the failed attempt's Unavailable", err)
		}
	})
}

// TestHedgedStreamCallerCatchersGetTheWinners: as for unary calls, the
// caller's Header, Trailer and Peer options get the winner's values.
func TestHedgedStreamCallerCatchersGetTheWinners(t *testing.T) {
	sc := newStreamScript()
	sc.on(2, func(ss grpc.ServerStream) error {
		_ = ss.SetHeader(metadata.Pairs("who", "hedge"))
		ss.SetTrailer(metadata.Pairs("who-t", "hedge"))
		return sendWords("h")(ss)
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2))
	var (
		header, trailer metadata.MD
		p               peer.Peer
	)
	s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{}, grpc.Header(&header), grpc.Trailer(&trailer), grpc.Peer(&p))
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	sc.hedgeAtDelay(t, clk)
	if words, err := recvAll(s.Recv); err != nil || !slices.Equal(words, []string{"h"}) {
		t.Fatalf("received %q, %v", words, err)
	}
	if !slices.Equal(header.Get("who"), []string{"hedge"}) || !slices.Equal(trailer.Get("who-t"), []string{"hedge"}) || p.Addr == nil {
		t.Errorf("header %v, trailer %v, peer %v; want the hedge's", header, trailer, p.Addr)
	}
	if err := sc.endedWith(t, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("the first attempt ended with %v, want cancelled", err)
	}
}

// Every attempt of a hedged stream fails non-fatally: the stream ends with
// the last failure, and the caller's grpc.Trailer and the stream's Trailer
// are that attempt's, as a hedged unary call's are.
func TestHedgedStreamExhaustedFillsTheLastAttempts(t *testing.T) {
	sc := newStreamScript()
	for n := 1; n <= 2; n++ {
		sc.on(n, func(ss grpc.ServerStream) error {
			ss.SetTrailer(metadata.Pairs("who", fmt.Sprint(n)))
			return status.Error(codes.Unavailable, fmt.Sprint("down ", n))
		})
	}
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(2, codes.Unavailable))
	var trailer metadata.MD
	s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{}, grpc.Trailer(&trailer))
	if err == nil {
		_, err = s.Recv()
	}
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeExhausted || re.Attempts != 2 || status.Convert(err).Message() != "down 2" {
		t.Fatalf("Recv: %v; want an exhausted RetryError after 2 attempts, with the second attempt's status", err)
	}
	if got := trailer.Get("who"); !slices.Equal(got, []string{"2"}) {
		t.Errorf("caller's trailer who=%q, want attempt 2's (the one whose status the stream ended with)", got)
	}
	if got := s.Trailer().Get("who"); !slices.Equal(got, []string{"2"}) {
		t.Errorf("stream's Trailer() who=%q, want attempt 2's", got)
	}
}

// The first attempt of a hedged bidi stream fails non-fatally, so the
// hedge goes at once; while it is still opening (a later interceptor holds
// it, as a connection with no free stream would), the caller sends a
// message that overflows the replay buffer. Send waits for the hedge, as
// gRPC's SendMsg waits for a retry's new attempt, and the stream goes on
// with it: it was in flight. (The hedge is let go from another goroutine,
// as Send waits; in either order the stream must go on with it.)
func TestHedgedStreamOverflowWaitsForTheOpeningHedge(t *testing.T) {
	sc := newStreamScript()
	sc.on(1, func(grpc.ServerStream) error { return status.Error(codes.Unavailable, "down 1") })
	sc.on(2, func(ss grpc.ServerStream) error {
		if err := sc.readAll(ss, 2, func() interface{ GetPayload() *testgrpc.Payload } { return new(testgrpc.StreamingOutputCallRequest) }); err != nil {
			return err
		}
		return ss.SendMsg(&testgrpc.StreamingOutputCallResponse{Payload: payload("from 2")})
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	gate, entered, release := gateAttempt(2)
	ic, err := New(withClock(clk), WithPolicy(hedging(3, codes.Unavailable)), WithStreamBuffer(16))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(gate))...)
	s, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	<-entered // attempt 1 failed; the hedge is opening
	go func() {
		time.Sleep(50 * time.Millisecond) // most likely while Send waits
		close(release)
	}()
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("far too large to keep")}); err != nil {
		t.Fatalf("Send: %v; want it sent to the hedge", err)
	}
	_ = s.CloseSend()
	words, err := recvAll(s.Recv)
	if err != nil || !slices.Equal(words, []string{"from 2"}) {
		t.Errorf("received %q, %v; want the hedge's answer (it was in flight when the buffer overflowed)", words, err)
	}
}

// Attempts 1 and 2 of a hedged stream fail non-fatally, the second with a
// pushback, so the third waits; the caller then overflows the buffer. The
// stream ends exhausted with the last failure (attempt 2's), as it does
// when Context commits it then.
func TestHedgedStreamOverflowAfterAllFailedEndsWithTheLast(t *testing.T) {
	sc := newStreamScript()
	sc.on(1, func(grpc.ServerStream) error { return status.Error(codes.Unavailable, "down 1") })
	sc.on(2, func(ss grpc.ServerStream) error {
		ss.SetTrailer(metadata.Pairs(wire.PushbackKey, "1000"))
		return status.Error(codes.Unavailable, "down 2")
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	c := hedgedStreamClient(t, srv, clk, hedging(3, codes.Unavailable), WithStreamBuffer(16))
	s, err := c.FullDuplexCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	sc.wait(t, 2)
	clk.waitArmed(t, time.Second) // the pushback's wait
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("far too large to keep")}); err != io.EOF {
		t.Errorf("Send: %v; want io.EOF, the stream is over", err)
	}
	_, err = s.Recv()
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeExhausted || status.Convert(err).Message() != "down 2" {
		t.Errorf("Recv: %v; want an exhausted RetryError with the last failure, attempt 2's down 2", err)
	}
	sc.none(t)
}

// gateAttempt returns a stream interceptor, to chain after herdguard's,
// that holds attempt n in opening until release is closed; entered is
// closed when it gets there.
func gateAttempt(n int) (grpc.StreamClientInterceptor, chan struct{}, chan struct{}) {
	entered, release := make(chan struct{}), make(chan struct{})
	want := fmt.Sprint(n)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if md, _ := metadata.FromOutgoingContext(ctx); slices.Contains(md.Get(wire.AttemptKey), want) {
			close(entered)
			select {
			case <-release:
			case <-ctx.Done():
				return nil, status.FromContextError(ctx.Err()).Err()
			}
		}
		return streamer(ctx, desc, cc, method, opts...)
	}, entered, release
}

// Hedge 2 is still opening when attempt 1 fails non-fatally with a
// pushback of 1 s, so hedge 3 must wait 1 s: hedge 2 going live after it
// sets the timer again, but not sooner than the pushback allows.
func TestHedgedStreamPushbackOutlastsAnOpeningHedge(t *testing.T) {
	sc := newStreamScript()
	fail1 := make(chan struct{})
	sc.on(1, func(ss grpc.ServerStream) error {
		<-fail1
		ss.SetTrailer(metadata.Pairs(wire.PushbackKey, "1000"))
		return status.Error(codes.Unavailable, "down 1")
	})
	srv, clk := startStreamScript(t, sc), newManualClock()
	gate, entered, release := gateAttempt(2)
	ic, err := New(withClock(clk), WithPolicy(hedging(3, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(gate))...)
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	if _, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}); err != nil {
		t.Fatal(err)
	}
	sc.wait(t, 1)
	clk.Advance(hedgeDelay) // hedge 2 starts opening
	<-entered
	close(fail1)                  // attempt 1 fails: pushback 1 s
	clk.waitArmed(t, time.Second) // the pushback's wait for hedge 3
	close(release)                // hedge 2 opens
	sc.wait(t, 2)
	// Set for the delay, for the pushback, then again as hedge 2 went live:
	// to the pushback's end, not to the hedging delay.
	if armed := clk.waitArmedN(t, 3); armed[2] != time.Second {
		t.Errorf("timer set to %v as hedge 2 went live; want %v, the pushback's wait (all: %v)", armed[2], time.Second, armed)
	}
	clk.Advance(hedgeDelay)
	sc.none(t) // hedge 3 waits for the pushback: 1 s, not 20 ms
	clk.Advance(time.Second)
	sc.wait(t, 3)
}

// benchStream is a server stream that answers at once: headers, one
// message, then the end.
type benchStream struct {
	ctx  context.Context
	recv int
}

func (s *benchStream) Header() (metadata.MD, error) { return benchHeader, nil }
func (s *benchStream) Trailer() metadata.MD         { return nil }
func (s *benchStream) CloseSend() error             { return nil }
func (s *benchStream) Context() context.Context     { return s.ctx }
func (s *benchStream) SendMsg(any) error            { return nil }
func (s *benchStream) RecvMsg(any) error {
	if s.recv++; s.recv > 1 {
		return io.EOF
	}
	return nil
}

var benchHeader = metadata.Pairs("k", "v")

// BenchmarkStreamAlone: a server stream through the interceptor alone,
// retried and hedged, that answers at once.
func BenchmarkStreamAlone(b *testing.B) {
	run := func(b *testing.B, p policy.Policy) {
		ic, err := New(WithTracerProvider(noopTP()), WithMeterProvider(noopMP()), WithPolicy(p))
		if err != nil {
			b.Fatal(err)
		}
		_, cc := alone(b)
		desc := &grpc.StreamDesc{ServerStreams: true}
		streamer := func(ctx context.Context, _ *grpc.StreamDesc, _ *grpc.ClientConn, _ string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
			return &benchStream{ctx: ctx}, nil
		}
		ctx, req, resp := context.Background(), &testgrpc.StreamingOutputCallRequest{}, &testgrpc.StreamingOutputCallResponse{}
		b.ReportAllocs()
		for b.Loop() {
			s, err := ic.Stream()(ctx, desc, cc, "/grpc.testing.TestService/StreamingOutputCall", streamer)
			if err != nil {
				b.Fatal(err)
			}
			if err := s.SendMsg(req); err != nil {
				b.Fatal(err)
			}
			_ = s.CloseSend()
			if err := s.RecvMsg(resp); err != nil {
				b.Fatal(err)
			}
			if err := s.RecvMsg(resp); err != io.EOF {
				b.Fatal(err)
			}
		}
	}
	b.Run("retried", func(b *testing.B) { run(b, policy.Policy{}) })
	b.Run("hedged", func(b *testing.B) { run(b, policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour}}) })
}

// pushbackRig is a hedged call or stream whose first attempt fails, when
// fail is closed, with a pushback, and whose second is held on its way out
// until release is closed (entered is closed when it gets there); every
// other attempt hangs.
type pushbackRig struct {
	fail, entered, release chan struct{}
	arrived                func(t *testing.T, n int) // attempt n reaches the server
	none                   func(t *testing.T)        // no attempt does, for a while
}

// unaryPushbackRig starts the rig's hedged unary call.
func unaryPushbackRig(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig {
	r := &pushbackRig{fail: make(chan struct{}), entered: make(chan struct{}), release: make(chan struct{})}
	srv := startHedgeServer(t)
	srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		<-r.fail
		_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.PushbackKey, pushbackMS))
		return nil, status.Error(codes.Unavailable, "down 1")
	})
	gate := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if md, _ := metadata.FromOutgoingContext(ctx); slices.Contains(md.Get(wire.AttemptKey), "2") {
			close(r.entered)
			select {
			case <-r.release:
			case <-ctx.Done():
				return status.FromContextError(ctx.Err()).Err()
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	ic, err := New(withClock(clk), WithPolicy(hedging(4, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(gate))...)
	ctx, cancel := context.WithCancel(ctxT(t))
	t.Cleanup(cancel)
	go func() { _, _ = c.UnaryCall(ctx, &testgrpc.SimpleRequest{}) }()
	r.arrived, r.none = srv.waitArrival, srv.noArrival
	return r
}

// streamPushbackRig starts the rig's hedged server stream.
func streamPushbackRig(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig {
	r := &pushbackRig{fail: make(chan struct{})}
	sc := newStreamScript()
	sc.on(1, func(ss grpc.ServerStream) error {
		<-r.fail
		ss.SetTrailer(metadata.Pairs(wire.PushbackKey, pushbackMS))
		return status.Error(codes.Unavailable, "down 1")
	})
	srv := startStreamScript(t, sc)
	gate, entered, release := gateAttempt(2)
	r.entered, r.release = entered, release
	ic, err := New(withClock(clk), WithPolicy(hedging(4, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(gate))...)
	ctx, cancel := context.WithCancel(ctxT(t))
	t.Cleanup(cancel)
	if _, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}); err != nil {
		t.Fatal(err)
	}
	r.arrived, r.none = sc.wait, sc.none
	return r
}

// TestHedgePushbackDelaysTheNextHedgeExactly: unary calls and streams share
// one rule for when a pushback delays the next hedge (see hedger): the next
// hedge goes exactly the pushback's delay after it came, the one after a
// hedging delay later (gRFC A6: "Send next hedged request in n ms.
// Subsequent hedged requests will resume at n + hedgingDelay"). Hedge 2 is
// still on its way out when attempt 1 is pushed back; its going out sets
// the timer neither sooner nor later than the pushback says, whether the
// pushback is shorter or longer than the hedging delay. Before the one
// rule, a stream's hedge 2 going live after a 5ms pushback set the timer
// to the 20ms hedging delay, and hedge 3 went 15ms late.
func TestHedgePushbackDelaysTheNextHedgeExactly(t *testing.T) {
	kinds := []struct {
		name  string
		start func(t *testing.T, clk *manualClock, pushbackMS string) *pushbackRig
	}{
		{"unary", unaryPushbackRig},
		{"stream", streamPushbackRig},
	}
	pushbacks := []struct {
		name string
		ms   string
		wait time.Duration
	}{
		{"shorter than the delay", "5", 5 * time.Millisecond},
		{"longer than the delay", "1000", time.Second},
	}
	for _, k := range kinds {
		for _, pb := range pushbacks {
			t.Run(k.name+"/"+pb.name, func(t *testing.T) {
				clk := newManualClock()
				r := k.start(t, clk, pb.ms)
				r.arrived(t, 1)
				clk.Advance(hedgeDelay) // hedge 2 goes, and is held on its way out
				<-r.entered
				close(r.fail) // attempt 1 fails, pushed back
				clk.waitArmed(t, pb.wait)
				close(r.release) // hedge 2 goes out
				r.arrived(t, 2)
				// Set for the first attempt, for hedge 2 and for the
				// pushback (unary, which arms as a hedge goes); or for
				// the first, the pushback, and as hedge 2 went live.
				clk.waitArmedN(t, 3)

				clk.Advance(pb.wait - time.Nanosecond)
				r.none(t)
				clk.Advance(time.Nanosecond)
				r.arrived(t, 3) // the pushback's delay after it came
				clk.waitArmedN(t, 4)

				clk.Advance(hedgeDelay - time.Nanosecond)
				r.none(t)
				clk.Advance(time.Nanosecond)
				r.arrived(t, 4) // then the hedging delay
			})
		}
	}
}
