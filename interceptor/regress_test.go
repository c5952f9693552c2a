package interceptor

// Regression tests for defects found in review. Each test asserts the
// correct behaviour, so it fails on the code that has the defect; run them
// together with
//
//	go test -race -run TestRegress ./interceptor/

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// Real-time bounds of these tests. Each is far from what it guards.
const (
	// stuckAfter is how long a stream method may take before the test takes
	// it for deadlocked; every method checked with it should return at once.
	stuckAfter = 3 * time.Second
	// hungDeadline is the caller's deadline on a call to a server that never
	// answers.
	hungDeadline = 50 * ms
	// regressAttemptTimeout is the per-attempt timeout of the test of a
	// stream whose context the caller took, and regressOutlive how long that
	// context must then stay live: five times as long.
	regressAttemptTimeout = 100 * ms
	regressOutlive        = 5 * regressAttemptTimeout
)

// modeKey is outgoing metadata that tells a test handler how to behave.
const modeKey = "regress-mode"

func withMode(ctx context.Context, mode string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, modeKey, mode)
}

func modeOf(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(modeKey); len(v) > 0 {
		return v[0]
	}
	return ""
}

// within runs fn on its own goroutine and returns its error, or an error
// saying that it panicked or did not return within stuckAfter. A goroutine
// that never returns is left behind (goleak then reports it too).
func within(what string, fn func() error) error {
	done := make(chan error, 1)
	go func() {
		returned := false
		defer func() {
			if !returned {
				done <- fmt.Errorf("%s panicked: %v", what, recover())
			}
		}()
		err := fn()
		returned = true
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(stuckAfter):
		return fmt.Errorf("%s did not return within %v: deadlocked", what, stuckAfter)
	}
}

// heldClock reads the wall clock, but its timers never fire: a backoff wait
// ends only when the call's context does. Every wait asked for is sent on
// waits while there is room.
type heldClock struct{ waits chan time.Duration }

func newHeldClock() *heldClock { return &heldClock{waits: make(chan time.Duration, 64)} }

func (c *heldClock) Now() time.Time { return time.Now() }

// AfterFunc returns a timer that never fires.
func (c *heldClock) AfterFunc(d time.Duration, _ func()) timer { return c.NewTimer(d) }

func (c *heldClock) NewTimer(d time.Duration) timer {
	t := &heldTimer{clock: c, c: make(chan time.Time)}
	t.Reset(d)
	return t
}

type heldTimer struct {
	clock *heldClock
	c     chan time.Time
}

func (t *heldTimer) C() <-chan time.Time { return t.c }
func (t *heldTimer) Stop() bool          { return true }
func (t *heldTimer) Reset(d time.Duration) bool {
	select {
	case t.clock.waits <- d:
	default:
	}
	return false
}

// flakyCreds are insecure client credentials that keep every connection
// they hand out and, once taken down, refuse every new one: the server is
// gone, so a new stream cannot be opened.
type flakyCreds struct {
	credentials.TransportCredentials

	mu    sync.Mutex
	conns []net.Conn
	down  bool
}

func newFlakyCreds() *flakyCreds {
	return &flakyCreds{TransportCredentials: insecure.NewCredentials()}
}

func (f *flakyCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.down {
		conn.Close()
		return nil, nil, errors.New("regress: the server is down")
	}
	f.conns = append(f.conns, conn)
	return f.TransportCredentials.ClientHandshake(ctx, authority, conn)
}

func (f *flakyCreds) Clone() credentials.TransportCredentials { return f }

// takeDown closes every connection made so far and refuses new ones.
func (f *flakyCreds) takeDown() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.down = true
	for _, c := range f.conns {
		c.Close()
	}
}

// regressStreamKind is a stream kind whose requests are
// StreamingOutputCallRequests and responses StreamingOutputCallResponses.
type regressStreamKind struct {
	name            string
	clientStreaming bool
	open            func(context.Context, testgrpc.TestServiceClient) (grpc.ClientStream, error)
}

var regressOutputKinds = []regressStreamKind{
	{"server stream", false, func(ctx context.Context, c testgrpc.TestServiceClient) (grpc.ClientStream, error) {
		s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			return nil, err
		}
		return s, nil
	}},
	{"bidi stream", true, func(ctx context.Context, c testgrpc.TestServiceClient) (grpc.ClientStream, error) {
		s, err := c.FullDuplexCall(ctx)
		if err != nil {
			return nil, err
		}
		return s, nil
	}},
}

// endedStream is a stream whose RecvMsg returned its final error.
type endedStream struct {
	cs      grpc.ClientStream
	kind    regressStreamKind
	err     error       // the final error the first RecvMsg returned
	trailer metadata.MD // the last trailer a server sent; nil for none
}

// recvAgain checks that RecvMsg returns the final error once more.
func (es *endedStream) recvAgain() error {
	err := es.cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
	if err == nil || status.Code(err) != status.Code(es.err) || err.Error() != es.err.Error() {
		return fmt.Errorf("RecvMsg again = %v, want the final error %v", err, es.err)
	}
	return nil
}

// TestRegressStreamAfterFailedReopen: once RecvMsg has returned a stream's
// final error, because its new attempt could not be opened or because the
// caller's context ended during the backoff, every method of the stream
// returns at once, without panicking, with a sensible value.
func TestRegressStreamAfterFailedReopen(t *testing.T) {
	entered := make(chan struct{})
	behave := func(ctx context.Context, setTrailer func(metadata.MD)) error {
		if modeOf(ctx) == "fail" {
			setTrailer(metadata.Pairs("last-attempt", strconv.Itoa(attemptOf(ctx))))
			return status.Error(codes.Unavailable, "regress: restarting")
		}
		select { // tell the test that the attempt is open, then hang
		case entered <- struct{}{}:
		case <-ctx.Done():
		}
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	}
	srv := testserver.Start(t, &testserver.Server{
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return behave(ss.Context(), ss.SetTrailer)
		},
		Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
			return behave(ss.Context(), ss.SetTrailer)
		},
	})

	scenarios := []struct {
		name string
		end  func(*testing.T, regressStreamKind) *endedStream
	}{
		{"reopen fails", func(t *testing.T, k regressStreamKind) *endedStream {
			// The first attempt opens; then the connection dies and no new
			// one can be made, so the retry cannot open its stream, and the
			// policy allows no attempt after it.
			creds := newFlakyCreds()
			ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(),
				WithPolicy(policy.Policy{MaxAttempts: 2}))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, append(ic.DialOptions(), grpc.WithTransportCredentials(creds))...)
			ctx := ctxT(t)
			cs, err := k.open(ctx, c)
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			select {
			case <-entered:
			case <-ctx.Done():
				t.Fatal("the first attempt never reached the server")
			}
			creds.takeDown()
			es := &endedStream{cs: cs, kind: k}
			if err := within("the first RecvMsg", func() error {
				es.err = cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			if status.Code(es.err) != codes.Unavailable {
				t.Fatalf("first RecvMsg: got %v, want Unavailable (the reopen failed)", es.err)
			}
			return es
		}},
		{"context ends during backoff", func(t *testing.T, k regressStreamKind) *endedStream {
			clk := newHeldClock()
			ic, err := New(withClock(clk), WithoutBreaker(),
				WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: ms}))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			ctx, cancel := context.WithCancel(ctxT(t))
			defer cancel()
			cs, err := k.open(withMode(ctx, "fail"), c)
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			got := make(chan error, 1)
			go func() { got <- cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse)) }()
			select {
			case <-clk.waits:
			case <-ctx.Done():
				t.Fatal("the stream never started a backoff wait")
			}
			cancel()
			es := &endedStream{cs: cs, kind: k, trailer: metadata.Pairs("last-attempt", "1")}
			select {
			case es.err = <-got:
			case <-time.After(callTimeout):
				t.Fatal("the first RecvMsg did not return after the context ended")
			}
			if status.Code(es.err) != codes.Canceled {
				t.Fatalf("first RecvMsg: got %v, want Canceled", es.err)
			}
			return es
		}},
	}

	methods := []struct {
		name  string
		check func(*endedStream) error
	}{
		{"Trailer", func(es *endedStream) error {
			md := es.cs.Trailer()
			if len(md) == 0 {
				return nil
			}
			if es.trailer == nil || !slices.Equal(md.Get("last-attempt"), es.trailer.Get("last-attempt")) {
				return fmt.Errorf("Trailer() = %v, want nil or the last trailer %v", md, es.trailer)
			}
			return nil
		}},
		{"Header", func(es *endedStream) error {
			if md, err := es.cs.Header(); err == nil && len(md) != 0 {
				return fmt.Errorf("Header() = %v, nil; want nil, nil or an error", md)
			}
			return nil
		}},
		{"Context", func(es *endedStream) error {
			if es.cs.Context() == nil {
				return errors.New("Context() = nil, want a context")
			}
			return nil
		}},
		{"CloseSend", func(es *endedStream) error {
			if err := es.cs.CloseSend(); err != nil {
				return fmt.Errorf("CloseSend() = %v, want nil", err)
			}
			return nil
		}},
		{"SendMsg", func(es *endedStream) error {
			err := es.cs.SendMsg(&testgrpc.StreamingOutputCallRequest{Payload: payload("late")})
			if es.kind.clientStreaming {
				if err != io.EOF {
					return fmt.Errorf("SendMsg() = %v, want io.EOF", err)
				}
				return nil
			}
			// A call that is not client-streaming has sent its one request:
			// gRPC answers a second SendMsg with Internal.
			if status.Code(err) != codes.Internal {
				return fmt.Errorf("SendMsg() = %v, want gRPC's Internal for a second request", err)
			}
			return nil
		}},
		{"RecvMsg", (*endedStream).recvAgain},
	}

	for _, sc := range scenarios {
		for _, k := range regressOutputKinds {
			for _, m := range methods {
				t.Run(sc.name+"/"+k.name+"/"+m.name, func(t *testing.T) {
					es := sc.end(t, k)
					if err := within(m.name, func() error { return m.check(es) }); err != nil {
						t.Error(err)
					}
					if m.name == "RecvMsg" {
						return
					}
					// a method that panicked while holding a lock would
					// leave the stream stuck
					if err := within("RecvMsg after "+m.name, es.recvAgain); err != nil {
						t.Error(err)
					}
				})
			}
		}
	}
}

// TestRegressCommitOnResponseHeaders: response headers commit a call
// (gRFC A6), so a failure after them is not retried; a trailers-only failure
// is.
func TestRegressCommitOnResponseHeaders(t *testing.T) {
	const maxAttempts = 4
	fail := func(ctx context.Context, sendHeader func(metadata.MD) error) error {
		if modeOf(ctx) == "headers" {
			if err := sendHeader(metadata.Pairs("served-by", strconv.Itoa(attemptOf(ctx)))); err != nil {
				return err
			}
		}
		return status.Error(codes.Unavailable, "regress: down")
	}
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, fail(ctx, func(md metadata.MD) error { return grpc.SendHeader(ctx, md) })
		},
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return fail(ss.Context(), ss.SendHeader)
		},
		Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
			return fail(ss.Context(), ss.SendHeader)
		},
	})
	c, _ := streamClient(t, srv, WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: maxAttempts, RetryableCodes: []codes.Code{codes.Unavailable}}))
	kinds := []struct {
		name string
		run  func(context.Context) error
	}{
		{"unary", func(ctx context.Context) error {
			_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
			return err
		}},
		{"server stream", func(ctx context.Context) error {
			s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		}},
		{"bidi stream", func(ctx context.Context) error {
			s, err := c.FullDuplexCall(ctx)
			if err != nil {
				return err
			}
			if err := s.CloseSend(); err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		}},
	}
	for _, k := range kinds {
		for _, tt := range []struct {
			mode string
			want int
		}{
			{"headers", 1},
			{"trailers-only", maxAttempts},
		} {
			t.Run(k.name+"/"+tt.mode, func(t *testing.T) {
				n := srv.Requests()
				err := k.run(withMode(ctxT(t), tt.mode))
				if status.Code(err) != codes.Unavailable {
					t.Errorf("got %v, want Unavailable", err)
				}
				if got := srv.Requests() - n; got != tt.want {
					t.Errorf("server saw %d attempts, want %d", got, tt.want)
				}
			})
		}
	}
}

// TestRegressContextCommitsStream: taking a stream's context commits it, as
// gRPC's does: it is not retried after, and the context the caller holds
// stays live while the stream goes on.
func TestRegressContextCommitsStream(t *testing.T) {
	t.Run("no retry after Context", func(t *testing.T) {
		failNow := make(chan struct{})
		srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			if attemptOf(ss.Context()) > 1 {
				return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("retried")})
			}
			select {
			case <-failNow:
			case <-ss.Context().Done():
			}
			return status.Error(codes.Unavailable, "regress: down")
		}})
		c, _ := streamClient(t, srv, WithoutBreaker())
		stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if stream.Context() == nil {
			t.Fatal("Context() = nil")
		}
		close(failNow)
		if m, err := stream.Recv(); status.Code(err) != codes.Unavailable {
			t.Errorf("Recv after Context() = %v, %v; want Unavailable: the stream committed when its context was taken", m, err)
		}
		if got := srv.Requests(); got != 1 {
			t.Errorf("server saw %d attempts, want 1", got)
		}
	})
	t.Run("held context outlives the per-attempt timeout", func(t *testing.T) {
		sendNow := make(chan struct{})
		srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			select {
			case <-sendNow:
			case <-ss.Context().Done():
				return status.FromContextError(ss.Context().Err()).Err()
			}
			for _, b := range []string{"a", "b", "c"} {
				if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(b)}); err != nil {
					return err
				}
			}
			return nil
		}})
		c, _ := streamClient(t, srv, WithoutBreaker(),
			WithPolicy(policy.Policy{MaxAttempts: 3, PerAttemptTimeout: regressAttemptTimeout}))
		stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
		if err != nil {
			t.Fatal(err)
		}
		held := stream.Context()
		select {
		case <-held.Done():
			t.Errorf("the context taken from the stream ended (%v) within %v, while the stream goes on", context.Cause(held), regressOutlive)
		case <-time.After(regressOutlive):
		}
		close(sendNow)
		var got []string
		for {
			m, err := stream.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("Recv after %q: %v", got, err)
			}
			got = append(got, string(m.GetPayload().GetBody()))
			if err := held.Err(); err != nil {
				t.Errorf("after receiving %q the held context has ended: %v; want it live", got, err)
			}
		}
		if want := []string{"a", "b", "c"}; !slices.Equal(got, want) {
			t.Errorf("received %q, want %q", got, want)
		}
		if n := srv.Requests(); n != 1 {
			t.Errorf("server saw %d attempts, want 1", n)
		}
	})
}

// TestRegressHeaderRetriesLikeRecv: a caller whose first call is Header gets
// the headers of the attempt that succeeds, as gRPC's Header retries.
func TestRegressHeaderRetriesLikeRecv(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		if attemptOf(ss.Context()) == 1 {
			return status.Error(codes.Unavailable, "regress: trailers only")
		}
		if err := ss.SendHeader(metadata.Pairs("k", "v")); err != nil {
			return err
		}
		for _, b := range []string{"a", "b", "c"} {
			if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(b)}); err != nil {
				return err
			}
		}
		return nil
	}})
	c, _ := streamClient(t, srv, WithoutBreaker())
	stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	md, err := stream.Header()
	if err != nil || !slices.Equal(md.Get("k"), []string{"v"}) {
		t.Errorf("Header() = %v, %v; want k=v from the second attempt, nil", md, err)
	}
	got, err := recvAll(stream.Recv)
	if want := []string{"a", "b", "c"}; err != nil || !slices.Equal(got, want) {
		t.Errorf("received %q, %v; want %q once each, then the end", got, err, want)
	}
	if n := srv.Requests(); n != 2 {
		t.Errorf("server saw %d attempts, want 2", n)
	}
}

// hungServer answers calls whose payload is "fail" with Unavailable at once
// and hangs on any other until its context ends. A hanging handler first
// offers a value on entered, so a test can learn that its attempt is in
// flight.
func hungServer(t *testing.T) (*testserver.Server, chan struct{}) {
	entered := make(chan struct{})
	hang := func(ctx context.Context, body []byte) error {
		if string(body) == "fail" {
			return status.Error(codes.Unavailable, "regress: down")
		}
		select {
		case entered <- struct{}{}:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	}
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(ctx context.Context, r *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, hang(ctx, r.GetPayload().GetBody())
		},
		ServerStream: func(r *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return hang(ss.Context(), r.GetPayload().GetBody())
		},
	})
	return srv, entered
}

// breakerKinds make one call of their kind with the given payload and
// return its error.
var breakerKinds = []struct {
	name string
	call func(context.Context, testgrpc.TestServiceClient, string) error
}{
	{"unary", func(ctx context.Context, c testgrpc.TestServiceClient, body string) error {
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: payload(body)})
		return err
	}},
	{"server stream", func(ctx context.Context, c testgrpc.TestServiceClient, body string) error {
		s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{Payload: payload(body)})
		if err != nil {
			return err
		}
		_, err = s.Recv()
		return err
	}},
}

// TestRegressHungBackendTripsBreaker: a call whose deadline (the caller's,
// or the policy's Timeout) runs out while its attempt waits on a server
// that does not answer is the server's failure, and opens the breaker like
// any other.
func TestRegressHungBackendTripsBreaker(t *testing.T) {
	const trip = 3
	srv, _ := hungServer(t)
	for _, deadline := range []string{"caller's", "Policy.Timeout"} {
		for _, k := range breakerKinds {
			t.Run(deadline+"/"+k.name, func(t *testing.T) {
				opts := []Option{WithBreaker(breaker.Settings{ConsecutiveFailures: trip})}
				callCtx := func() (context.Context, context.CancelFunc) {
					return context.WithTimeout(context.Background(), hungDeadline)
				}
				if deadline == "Policy.Timeout" {
					opts = append(opts, WithPolicy(policy.Policy{Timeout: hungDeadline}))
					callCtx = func() (context.Context, context.CancelFunc) {
						return context.WithTimeout(context.Background(), 100*hungDeadline) // far beyond the policy's
					}
				}
				c, ic := streamClient(t, srv, opts...)
				for i := range trip {
					ctx, cancel := callCtx()
					err := k.call(ctx, c, "hang")
					cancel()
					if status.Code(err) != codes.DeadlineExceeded {
						t.Fatalf("call %d: got %v, want DeadlineExceeded", i+1, err)
					}
				}
				if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Open {
					t.Errorf("breaker %v after %d calls timed out on a hung server, want open", got, trip)
				}
				n := srv.Requests()
				ctx, cancel := callCtx()
				defer cancel()
				if err := k.call(ctx, c, "hang"); !errors.Is(err, breaker.ErrOpen) {
					t.Errorf("call %d: got %v, want it refused with breaker.ErrOpen", trip+1, err)
				}
				if got := srv.Requests() - n; got != 0 {
					t.Errorf("call %d reached the server %d times, want 0", trip+1, got)
				}
			})
		}
	}
}

// TestRegressCallerEndedCallsDoNotTrip: calls the caller ended itself say
// nothing about the server and leave the breaker closed, however many.
func TestRegressCallerEndedCallsDoNotTrip(t *testing.T) {
	const (
		trip = 3
		runs = trip + 1
	)
	srv, entered := hungServer(t)
	cases := []struct {
		name string
		want codes.Code
		// run makes one call that the caller ends.
		run func(t *testing.T, clk *heldClock, call func(context.Context, string) error) error
	}{
		{"cancelled in flight", codes.Canceled, func(t *testing.T, _ *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithCancel(ctxT(t))
			defer cancel()
			got := make(chan error, 1)
			go func() { got <- call(ctx, "hang") }()
			select {
			case <-entered:
			case err := <-got:
				return fmt.Errorf("the call ended before it reached the server: %w", err)
			}
			cancel()
			return <-got
		}},
		{"deadline during backoff", codes.DeadlineExceeded, func(t *testing.T, clk *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithTimeout(context.Background(), hungDeadline)
			defer cancel()
			err := call(ctx, "fail")
			select {
			case <-clk.waits:
			default:
				t.Error("the call started no backoff wait: the case tests nothing")
			}
			return err
		}},
		{"deadline passed before the call", codes.DeadlineExceeded, func(t *testing.T, _ *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
			defer cancel()
			return call(ctx, "hang")
		}},
	}
	for _, k := range breakerKinds {
		for _, tt := range cases {
			t.Run(k.name+"/"+tt.name, func(t *testing.T) {
				clk := newHeldClock()
				ic, err := New(withClock(clk), WithBreaker(breaker.Settings{ConsecutiveFailures: trip}),
					WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: ms}))
				if err != nil {
					t.Fatal(err)
				}
				c := srv.Client(t, ic.DialOptions()...)
				call := func(ctx context.Context, body string) error { return k.call(ctx, c, body) }
				for i := range runs {
					if err := tt.run(t, clk, call); status.Code(err) != tt.want {
						t.Fatalf("call %d: got %v, want %v", i+1, err, tt.want)
					}
				}
				if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Closed {
					t.Errorf("breaker %v after %d such calls, want closed", got, runs)
				}
			})
		}
	}
}

// TestRegressLongStreamClosesHalfOpenBreaker: a probe stream the server
// has answered has shown the server healthy; the breaker closes then, not
// when the (long) stream ends, and lets other calls through: when the
// caller received a message, and when the server sent headers alone that
// the caller has not read, also after Context() committed the stream
// before they came.
//
// It runs in real time, as gobreaker reads the wall clock: the open period
// is short and the waits for the breaker generous.
func TestRegressLongStreamClosesHalfOpenBreaker(t *testing.T) {
	for _, tc := range []struct {
		name    string
		message bool // the server sends a message, or headers alone
		context bool // the caller calls Context() first
	}{
		{"a message received", true, false},
		{"headers unread", false, false},
		{"headers unread after Context", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var failing atomic.Bool
			failing.Store(true)
			release := make(chan struct{})
			stopProbe := sync.OnceFunc(func() { close(release) })
			defer stopProbe()
			srv := testserver.Start(t, &testserver.Server{
				Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
					if failing.Load() {
						return nil, status.Error(codes.Unavailable, "regress: down")
					}
					return &testgrpc.SimpleResponse{}, nil
				},
				ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
					var err error
					if tc.message {
						err = ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("first")})
					} else {
						err = ss.SendHeader(metadata.Pairs("watch", "on"))
					}
					if err != nil {
						return err
					}
					select {
					case <-release:
					case <-ss.Context().Done():
					}
					return nil
				},
			})
			c, ic := streamClient(t, srv, WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 50 * ms}))
			b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
			if err := call(t, c); status.Code(err) != codes.Unavailable {
				t.Fatalf("tripping call: got %v, want Unavailable", err)
			}
			if got := b.State(); got != breaker.Open {
				t.Fatalf("breaker %v, want open", got)
			}
			waitHalfOpen(t, b)
			failing.Store(false)

			stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
			if err != nil {
				t.Fatalf("probe stream: %v", err)
			}
			if tc.context {
				_ = stream.Context()
			}
			if tc.message {
				if m, err := stream.Recv(); err != nil || string(m.GetPayload().GetBody()) != "first" {
					t.Fatalf("probe's first Recv = %v, %v; want first", m, err)
				}
			}
			// The headers are the server's answer, whenever they come.
			deadline := time.Now().Add(callTimeout)
			for b.State() != breaker.Closed && time.Now().Before(deadline) {
				time.Sleep(5 * ms)
			}
			if got := b.State(); got != breaker.Closed {
				t.Errorf("breaker %v while the answered probe stream is open, want closed", got)
			}
			if err := call(t, c); err != nil {
				t.Errorf("unary call while the answered probe stream is open: got %v, want nil", err)
			}
			stopProbe()
			if tc.message {
				if m, err := stream.Recv(); err != io.EOF {
					t.Errorf("probe's last Recv = %v, %v; want io.EOF", m, err)
				}
			} else if md, err := stream.Header(); err != nil || md.Get("watch")[0] != "on" {
				t.Errorf("probe's Header() = %v, %v; want watch: on", md, err)
			} else if m, err := stream.Recv(); err != io.EOF {
				t.Errorf("probe's Recv = %v, %v; want io.EOF", m, err)
			}
		})
	}
}

// sendRecorder is a stream interceptor that records, per attempt, every
// message handed to SendMsg: a clone of a proto message, else the message.
type sendRecorder struct {
	mu       sync.Mutex
	attempts [][]any
}

func (r *sendRecorder) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts = append(r.attempts, nil)
	return &recordingStream{ClientStream: cs, r: r, i: len(r.attempts) - 1}, nil
}

func (r *sendRecorder) sent() [][]any {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([][]any, len(r.attempts))
	for i, a := range r.attempts {
		out[i] = slices.Clone(a)
	}
	return out
}

type recordingStream struct {
	grpc.ClientStream
	r *sendRecorder
	i int
}

func (s *recordingStream) SendMsg(m any) error {
	kept := m
	if pm, ok := m.(proto.Message); ok {
		kept = proto.Clone(pm)
	}
	s.r.mu.Lock()
	s.r.attempts[s.i] = append(s.r.attempts[s.i], kept)
	s.r.mu.Unlock()
	return s.ClientStream.SendMsg(m)
}

// TestRegressLaterInterceptorsSeeCallerMessages: an interceptor chained
// after herdguard's sees the caller's own message type, on the first send
// and on every replay, with the same content in the same order.
func TestRegressLaterInterceptorsSeeCallerMessages(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		for {
			if _, err := ss.Recv(); err == io.EOF {
				break
			} else if err != nil {
				return err
			}
		}
		if attemptOf(ss.Context()) == 1 {
			return status.Error(codes.Unavailable, "regress: lost it all")
		}
		return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{})
	}})
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker())
	if err != nil {
		t.Fatal(err)
	}
	var rec sendRecorder
	c := srv.Client(t, grpc.WithChainUnaryInterceptor(ic.Unary()), grpc.WithChainStreamInterceptor(ic.Stream(), rec.intercept))
	stream, err := c.StreamingInputCall(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	var want []*testgrpc.StreamingInputCallRequest
	for _, b := range []string{"a", "bb", "ccc"} {
		m := &testgrpc.StreamingInputCallRequest{Payload: payload(b)}
		want = append(want, m)
		if err := stream.Send(m); err != nil {
			t.Fatalf("Send(%s): %v", b, err)
		}
	}
	if _, err := stream.CloseAndRecv(); err != nil {
		t.Fatalf("CloseAndRecv: %v", err)
	}
	sent := rec.sent()
	if len(sent) != 2 {
		t.Fatalf("the later interceptor saw %d attempts, want 2", len(sent))
	}
	for i, got := range sent {
		if len(got) != len(want) {
			t.Errorf("attempt %d: the later interceptor saw %d messages, want %d", i+1, len(got), len(want))
			continue
		}
		for j, m := range got {
			gm, ok := m.(*testgrpc.StreamingInputCallRequest)
			if !ok {
				t.Errorf("attempt %d message %d: got %T, want %T", i+1, j+1, m, want[j])
				continue
			}
			if !proto.Equal(gm, want[j]) {
				t.Errorf("attempt %d message %d: got %v, want %v", i+1, j+1, gm, want[j])
			}
		}
	}
}

// grpcRetryConfig is a service config whose retry policy makes gRPC itself
// retry Unavailable, up to maxAttempts attempts; throttling, if not empty,
// is added as its retryThrottling.
func grpcRetryConfig(maxAttempts int, throttling string) string {
	sc := fmt.Sprintf(`{"methodConfig": [{"name": [{"service": "grpc.testing.TestService"}],
		"retryPolicy": {"maxAttempts": %d, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
			"backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]`, maxAttempts)
	if throttling != "" {
		sc += `, "retryThrottling": ` + throttling
	}
	return sc + "}"
}

// TestRegressAttemptsDoNotMultiplyWithGRPCRetry: with gRPC's own retry also
// configured, a call makes herdguard's attempts, not herdguard's times
// gRPC's.
func TestRegressAttemptsDoNotMultiplyWithGRPCRetry(t *testing.T) {
	const attempts = 5
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, status.Error(codes.Unavailable, "regress: down")
		},
		ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
			return status.Error(codes.Unavailable, "regress: down")
		},
	})
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: attempts, RetryableCodes: []codes.Code{codes.Unavailable}}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithDefaultServiceConfig(grpcRetryConfig(3, "")))...)
	for _, k := range breakerKinds {
		t.Run(k.name, func(t *testing.T) {
			n := srv.Requests()
			if err := k.call(ctxT(t), c, ""); status.Code(err) != codes.Unavailable {
				t.Errorf("got %v, want Unavailable", err)
			}
			if got := srv.Requests() - n; got != attempts {
				t.Errorf("server saw %d attempts, want %d", got, attempts)
			}
		})
	}
}

// TestRegressThrottlingMatchesGRPC: a trailers-only answer with a pushback
// that says stop takes a throttling token even when its code is not
// retryable, as in gRPC. Five of them leave half the tokens of ten, so the
// next retryable failure is not retried, by gRPC's own retry (the control)
// nor by herdguard.
func TestRegressThrottlingMatchesGRPC(t *testing.T) {
	const (
		maxAttempts = 3
		stops       = 5
	)
	trailers := map[string]metadata.MD{
		"negative pushback":   {wire.PushbackKey: {"-1"}},
		"two pushback values": {wire.PushbackKey: {"10", "20"}},
	}
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, r *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if md := trailers[string(r.GetPayload().GetBody())]; md != nil {
			if err := grpc.SetTrailer(ctx, md); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.Internal, "regress: broken, do not retry")
		}
		return nil, status.Error(codes.Unavailable, "regress: down")
	}})
	for _, name := range []string{"negative pushback", "two pushback values"} {
		t.Run(name, func(t *testing.T) {
			// lastAttempts makes the stop calls, then one that fails
			// Unavailable, and returns how many attempts the last one made.
			lastAttempts := func(c testgrpc.TestServiceClient) int {
				t.Helper()
				for i := range stops {
					_, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{Payload: payload(name)})
					if status.Code(err) != codes.Internal {
						t.Fatalf("call %d: got %v, want Internal", i+1, err)
					}
				}
				n := srv.Requests()
				if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) != codes.Unavailable {
					t.Fatalf("last call: got %v, want Unavailable", err)
				}
				return srv.Requests() - n
			}
			ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(),
				WithPolicy(policy.Policy{MaxAttempts: maxAttempts, RetryableCodes: []codes.Code{codes.Unavailable}}),
				WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1}))
			if err != nil {
				t.Fatal(err)
			}
			got := lastAttempts(srv.Client(t, ic.DialOptions()...))
			control := lastAttempts(srv.Client(t,
				grpc.WithDefaultServiceConfig(grpcRetryConfig(maxAttempts, `{"maxTokens": 10, "tokenRatio": 0.1}`))))
			if control != 1 {
				t.Errorf("control: gRPC's own retry made %d attempts of the last call, want 1", control)
			}
			if got != control {
				t.Errorf("herdguard made %d attempts of the last call, gRPC's own retry %d; want the same", got, control)
			}
		})
	}
}

// TestRegressSingleAttemptErrorAsIs: a call allowed one attempt returns that
// attempt's error as it is, not wrapped in a RetryError.
func TestRegressSingleAttemptErrorAsIs(t *testing.T) {
	down := status.Error(codes.Unavailable, "regress: down")
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, down
		},
		ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
			return down
		},
	})
	one := policy.Policy{MaxAttempts: 1}
	for _, tt := range []struct {
		name string
		opts []Option
		call []grpc.CallOption
	}{
		{"NoRetry", nil, []grpc.CallOption{NoRetry()}},
		{"CallPolicy", nil, []grpc.CallOption{CallPolicy(one)}},
		{"WithPolicy", []Option{WithPolicy(one)}, nil},
	} {
		for _, k := range []struct {
			name string
			run  func(context.Context, testgrpc.TestServiceClient, ...grpc.CallOption) error
		}{
			{"unary", func(ctx context.Context, c testgrpc.TestServiceClient, opts ...grpc.CallOption) error {
				_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}, opts...)
				return err
			}},
			{"server stream", func(ctx context.Context, c testgrpc.TestServiceClient, opts ...grpc.CallOption) error {
				s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}, opts...)
				if err != nil {
					return err
				}
				_, err = s.Recv()
				return err
			}},
		} {
			t.Run(tt.name+"/"+k.name, func(t *testing.T) {
				c, _ := streamClient(t, srv, append(tt.opts, WithoutBreaker())...)
				n := srv.Requests()
				err := k.run(ctxT(t), c, tt.call...)
				if errors.As(err, new(*RetryError)) {
					t.Errorf("got %v, a *RetryError; want the attempt's error as it is", err)
				}
				if err == nil || err.Error() != down.Error() {
					t.Errorf("got %v, want %q", err, down.Error())
				}
				if got := srv.Requests() - n; got != 1 {
					t.Errorf("server saw %d attempts, want 1", got)
				}
			})
		}
	}
}

// spanEnded is a span processor that signals on ch every end of a span
// named name.
type spanEnded struct {
	name string
	ch   chan struct{}
}

func (p *spanEnded) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (p *spanEnded) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.Name() == p.name {
		select {
		case p.ch <- struct{}{}:
		default:
		}
	}
}
func (p *spanEnded) Shutdown(context.Context) error   { return nil }
func (p *spanEnded) ForceFlush(context.Context) error { return nil }

// TestRegressIdleStreamDeadlineNoRace: the deadline of a stream nobody
// reads from ends it on a goroutine of its own; under -race, the detector
// must stay quiet. The stream is bidi so that nothing (the generated code's
// SendMsg and CloseSend included) touches it after it opens, which would
// order its accesses by chance.
func TestRegressIdleStreamDeadlineNoRace(t *testing.T) {
	const streams = 3
	srv := testserver.Start(t, &testserver.Server{Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
		<-ss.Context().Done()
		return status.FromContextError(ss.Context().Err()).Err()
	}})
	ended := &spanEnded{name: "grpc.testing.TestService/FullDuplexCall", ch: make(chan struct{}, streams)}
	c, _ := streamClient(t, srv, WithoutBreaker(),
		WithTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(ended))))
	for i := range streams {
		ctx, cancel := context.WithTimeout(context.Background(), hungDeadline)
		if _, err := c.FullDuplexCall(ctx); err != nil {
			cancel()
			t.Fatalf("stream %d: %v", i+1, err)
		}
		select { // the stream ends on its own when its deadline passes
		case <-ended.ch:
		case <-time.After(callTimeout):
			t.Fatalf("stream %d: its call span did not end within %v of its deadline", i+1, callTimeout)
		}
		cancel()
	}
}

// TestRegressSharedDeadlineReportsDeadlineExceeded: streams whose shared
// deadline passes while the server has not answered end with
// DeadlineExceeded, never Canceled.
func TestRegressSharedDeadlineReportsDeadlineExceeded(t *testing.T) {
	const (
		rounds         = 25
		streams        = 20
		sharedDeadline = 100 * ms
	)
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		<-ss.Context().Done()
		return status.FromContextError(ss.Context().Err()).Err()
	}})
	c, _ := streamClient(t, srv, WithoutBreaker())
	var wrong []string
	for r := range rounds {
		ctx, cancel := context.WithTimeout(context.Background(), sharedDeadline)
		errs := make([]error, streams)
		var wg sync.WaitGroup
		for i := range streams {
			wg.Go(func() {
				s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
				if err == nil {
					_, err = s.Recv()
				}
				errs[i] = err
			})
		}
		wg.Wait()
		cancel()
		for i, err := range errs {
			if status.Code(err) != codes.DeadlineExceeded {
				wrong = append(wrong, fmt.Sprintf("round %d stream %d: %v", r+1, i+1, err))
			}
		}
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d streams got another code, want DeadlineExceeded; first: %s",
			len(wrong), rounds*streams, wrong[0])
	}
}

// TestRegressNilClientConn: an interceptor called directly, with no
// connection (as tests and benchmarks call invokers), must not panic on the
// missing target: it runs with the target "".
func TestRegressNilClientConn(t *testing.T) {
	ic, err := New()
	if err != nil {
		t.Fatal(err)
	}
	invoked := 0
	invoker := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		invoked++
		return nil
	}
	if err := ic.Unary()(ctxT(t), testserver.MethodUnary, nil, nil, nil, invoker); err != nil || invoked != 1 {
		t.Errorf("unary with no connection: %v after %d attempts, want nil after 1", err, invoked)
	}
	denied := status.Error(codes.PermissionDenied, "no")
	streamer := func(context.Context, *grpc.StreamDesc, *grpc.ClientConn, string, ...grpc.CallOption) (grpc.ClientStream, error) {
		return nil, denied
	}
	desc := &grpc.StreamDesc{ServerStreams: true}
	s, err := ic.Stream()(ctxT(t), desc, nil, "/grpc.testing.TestService/StreamingOutputCall", streamer)
	if err == nil {
		err = s.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("stream with no connection: %v, want the streamer's PermissionDenied", err)
	}
}

// TestRegressLaterInterceptorAppendsOption: an interceptor chained after
// herdguard may append to the call options it is given (many add
// WaitForReady, or a per-call credential). The options herdguard passes
// come from a pooled buffer, which also holds the catchers the next call
// uses to see response headers (gRFC A6's commit rule); an append must
// not write over them. Each round makes a call that may not be retried
// (its one attempt carries no catchers), then a call whose server sends
// headers before it fails: that call is committed, one attempt.
func TestRegressLaterInterceptorAppendsOption(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			if err := grpc.SendHeader(ctx, metadata.Pairs("k", "v")); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.Unavailable, "regress: down after headers")
		},
		Empty: func(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) { return &testgrpc.Empty{}, nil },
	})
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: 3, RetryableCodes: []codes.Code{codes.Unavailable}}),
		WithMethodPolicy(testserver.MethodEmpty, policy.Policy{MaxAttempts: 1}))
	if err != nil {
		t.Fatal(err)
	}
	appendOption := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(ctx, method, req, reply, cc, append(opts, grpc.WaitForReady(false))...)
	}
	// Invoked with no call options (generated code passes
	// grpc.StaticMethod), so that the attempts carry herdguard's alone.
	cc := srv.Dial(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(appendOption))...)
	for i := range 50 {
		if err := cc.Invoke(ctxT(t), testserver.MethodEmpty, &testgrpc.Empty{}, &testgrpc.Empty{}); err != nil {
			t.Fatalf("round %d: EmptyCall: %v", i, err)
		}
		n := srv.Requests()
		err := cc.Invoke(ctxT(t), testserver.MethodUnary, &testgrpc.SimpleRequest{}, &testgrpc.SimpleResponse{})
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("round %d: got %v, want Unavailable", i, err)
		}
		if got := srv.Requests() - n; got != 1 {
			t.Fatalf("round %d: a call whose server sent headers made %d attempts, want 1 (committed)", i, got)
		}
	}
}
