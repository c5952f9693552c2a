package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// concurrencyRounds is how many streams each race test runs through; the
// races they guard against showed within a few hundred.
const concurrencyRounds = 300

// failReopen is a stream interceptor chained after herdguard's that makes
// every retry fail to open.
func failReopen(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(wire.AttemptKey)) > 0 {
		return nil, status.Error(codes.Unavailable, "cannot reopen")
	}
	return streamer(ctx, desc, cc, method, opts...)
}

func alwaysUnavailable(testgrpc.TestService_FullDuplexCallServer) error {
	return status.Error(codes.Unavailable, "down")
}

// TestConcurrentMethodsWhenTheRetryCannotOpen: while one goroutine's
// RecvMsg finds the retry unable to open and gives up, others call SendMsg
// and Header on the same stream. None may find the stream given up but not
// ended, with an attempt that never opened, and panic on it.
func TestConcurrentMethodsWhenTheRetryCannotOpen(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Bidi: alwaysUnavailable})
	// Every attempt fails: the overload controller would pace them.
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 2}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(failReopen))...)
	var panicked atomic.Bool
	for i := 0; i < concurrencyRounds && !panicked.Load(); i++ {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		cs, err := c.FullDuplexCall(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		guard := func(name string, f func()) {
			wg.Go(func() {
				defer func() {
					if r := recover(); r != nil && !panicked.Swap(true) {
						t.Errorf("round %d: %s panicked: %v\n%s", i, name, r, debug.Stack())
					}
				}()
				f()
			})
		}
		guard("RecvMsg", func() {
			if err := cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse)); status.Code(err) != codes.Unavailable {
				t.Errorf("round %d: RecvMsg = %v, want Unavailable", i, err)
			}
		})
		guard("SendMsg", func() {
			for cs.SendMsg(&testgrpc.StreamingOutputCallRequest{}) == nil {
			}
		})
		guard("Header", func() {
			for range 20 {
				_, _ = cs.Header()
			}
		})
		wg.Wait()
		cancel()
	}
}

// TestCommitWhileSendLearnsTheEnd: a SendMsg that began before the stream
// committed finds its attempt over and learns how by receiving on it, while
// the caller's other goroutine commits the stream (Context) and receives.
// Two receives at once on one gRPC stream would lose its end and hang.
func TestCommitWhileSendLearnsTheEnd(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Bidi: alwaysUnavailable})
	// Every attempt fails: the overload controller would find the server
	// down and open no stream.
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 2}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	const margin = 5 * time.Second
	for i := 0; i < concurrencyRounds && !t.Failed(); i++ {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		cs, err := c.FullDuplexCall(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Go(func() {
			var err error
			for err = cs.SendMsg(&testgrpc.StreamingOutputCallRequest{}); err == nil; err = cs.SendMsg(&testgrpc.StreamingOutputCallRequest{}) {
			}
			if err != io.EOF {
				t.Errorf("round %d: SendMsg ended with %v, want io.EOF (the stream's end is RecvMsg's to tell)", i, err)
			}
		})
		wg.Go(func() {
			for range i % 50 { // vary where the commit lands
			}
			_ = cs.Context() // commits the stream
			if err := cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse)); status.Code(err) != codes.Unavailable {
				t.Errorf("round %d: RecvMsg = %v, want the server's Unavailable", i, err)
			}
		})
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(callTimeout + margin):
			t.Fatalf("round %d: SendMsg or RecvMsg still blocked %v after the stream's deadline", i, margin)
		}
		cancel()
	}
}

// rejectSends is a stream whose SendMsg a later interceptor refuses.
type rejectSends struct{ grpc.ClientStream }

func (rejectSends) SendMsg(any) error {
	return status.Error(codes.InvalidArgument, "a validator after herdguard refuses the message")
}

// TestReplayRefusedByALaterInterceptor: when an interceptor after
// herdguard's refuses a replayed message, the new attempt, still alive, is
// ended before it is judged, so the stream fails at once with that error
// instead of waiting for the attempt's headers until its deadline. It is the
// client's own error: not retried, and not counted by the breaker.
func TestReplayRefusedByALaterInterceptor(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
		if attemptOf(ss.Context()) == 1 {
			if _, err := ss.Recv(); err != nil {
				return err
			}
			return status.Error(codes.Unavailable, "down")
		}
		for { // a healthy attempt: reads until the client half-closes
			if _, err := ss.Recv(); err == io.EOF {
				return nil
			} else if err != nil {
				return err
			}
		}
	}})
	validator := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if md, _ := metadata.FromOutgoingContext(ctx); err == nil && len(md.Get(wire.AttemptKey)) > 0 {
			return rejectSends{cs}, nil
		}
		return cs, err
	}
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainStreamInterceptor(validator))...)
	const deadline, prompt = 3 * time.Second, time.Second
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	s, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&testgrpc.StreamingOutputCallRequest{}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = s.Recv()
	if took := time.Since(start); took > prompt || status.Code(err) != codes.InvalidArgument {
		t.Errorf("Recv = %v after %v; want the validator's InvalidArgument within %v", err, took, prompt)
	}
	if n := srv.Requests(); n > 2 {
		t.Errorf("server saw %d attempts, want at most 2: the refused replay is not retried", n)
	}
	if got := ic.Breakers().Get(testserver.Target, "/grpc.testing.TestService/FullDuplexCall").State(); got != breaker.Closed {
		t.Errorf("breaker %v after a stream the client refused, want closed", got)
	}
}

// TestHeadersStopThePerAttemptTimeout: a server that sends its headers at
// once and its first message later than PerAttemptTimeout has the stream
// (gRFC A6): the per-attempt timeout stops when the headers arrive, even
// if nobody reads them.
func TestHeadersStopThePerAttemptTimeout(t *testing.T) {
	const timeout, late = 100 * time.Millisecond, 500 * time.Millisecond
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if err := ss.SendHeader(metadata.Pairs("k", "v")); err != nil {
			return err
		}
		time.Sleep(late)
		return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("late")})
	}})
	c, _ := streamClient(t, srv, WithoutBreaker(), withClock(clock.Real()), // the per-attempt timeout in real time
		WithPolicy(policy.Policy{PerAttemptTimeout: timeout}))
	s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.Recv() // called at once: the headers arrive while it waits
	if err != nil || string(m.GetPayload().GetBody()) != "late" {
		t.Errorf("Recv = %v, %v; want the late message: the headers committed the stream", m, err)
	}
	if n := srv.Requests(); n != 1 {
		t.Errorf("server saw %d attempts, want 1", n)
	}
}

// TestPerAttemptTimeoutAtTheFirstMessage: a server that answers just as
// the per-attempt timeout fires. The timeout and the stream's commit race,
// and whichever comes first wins: a stream that delivered a message is
// committed and never cancelled by its attempt's timeout, and a stream
// whose attempt timed out first fails with DeadlineExceeded (its server
// sent headers, so it is not retried) without delivering a message.
// Before, the timer cancelled the attempt of a stream already committed:
// about 7 % of the streams failed with Canceled after 1 to 3 messages.
func TestPerAttemptTimeoutAtTheFirstMessage(t *testing.T) {
	const d = 5 * time.Millisecond
	srv := testserver.Start(t, &testserver.Server{NoRecord: true, ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		time.Sleep(d)
		for range 3 {
			if err := ss.Send(&testgrpc.StreamingOutputCallResponse{}); err != nil {
				return err
			}
			time.Sleep(2 * time.Millisecond)
		}
		return nil
	}})
	// The real clock: an attempt that times out before the headers is
	// retried after a real wait.
	ic, err := New(WithoutBreaker(), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 2, PerAttemptTimeout: d, InitialBackoff: time.Millisecond}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		bad     = map[string]int{}
		ok, exp int
	)
	sem := make(chan struct{}, 16)
	for range 600 {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
			n := 0
			for err == nil {
				if _, err = s.Recv(); err == nil {
					n++
				}
			}
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == io.EOF && n == 3:
				ok++
			case n == 0 && status.Code(err) == codes.DeadlineExceeded:
				exp++
			default:
				bad[fmt.Sprintf("%v after %d messages", status.Code(err), n)]++
			}
		}()
	}
	wg.Wait()
	if len(bad) > 0 {
		t.Errorf("%d whole, %d timed out; and %v", ok, exp, bad)
	}
	t.Logf("%d whole, %d timed out before any message", ok, exp)
}

// TestClientSideErrorsAreNotRetried: a request over the call's send limit
// fails in gRPC before it leaves the client, with ResourceExhausted, a code
// retried by default. gRPC's own retry never retries it, and it says
// nothing of the server: one attempt, and the breaker stays closed.
func TestClientSideErrorsAreNotRetried(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.OK).unary})
	var attempts atomic.Int32
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		attempts.Add(1)
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(count))...)
	big := &testgrpc.SimpleRequest{Payload: payload("far more than ten bytes")}
	for i := range breaker.DefaultConsecutiveFailures + 1 {
		attempts.Store(0)
		_, err := c.UnaryCall(ctxT(t), big, grpc.MaxCallSendMsgSize(10))
		var re *RetryError
		if status.Code(err) != codes.ResourceExhausted || errors.As(err, &re) || attempts.Load() != 1 {
			t.Fatalf("call %d: %v after %d attempts; want gRPC's own ResourceExhausted after 1", i+1, err, attempts.Load())
		}
	}
	if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); err != nil {
		t.Errorf("a small call after the refused ones: %v; want it through a closed breaker", err)
	}
}
