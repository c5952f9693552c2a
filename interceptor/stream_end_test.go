package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testutil"
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

// TestStreamAfterFailedReopen: once RecvMsg has returned a stream's
// final error, because its new attempt could not be opened or because the
// caller's context ended during the backoff, every method of the stream
// returns at once, without panicking, with a sensible value.
func TestStreamAfterFailedReopen(t *testing.T) {
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
			testutil.Eventually(t, "the stream to start a backoff wait", func() bool { return len(clk.Delays()) > 0 })
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

// TestCommitOnResponseHeaders: response headers commit a call
// (gRFC A6), so a failure after them is not retried; a trailers-only failure
// is.
func TestCommitOnResponseHeaders(t *testing.T) {
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
	c, _ := streamClient(t, srv, WithoutBreaker(), WithoutOverloadControl(), // every attempt is refused: a collapse to the controller
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

// TestContextCommitsStream: taking a stream's context commits it, as
// gRPC's does: it is not retried after, and the context the caller holds
// stays live while the stream goes on.
func TestContextCommitsStream(t *testing.T) {
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
		c, _ := streamClient(t, srv, WithoutBreaker(), withClock(clock.Real()), // the per-attempt timeout in real time
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

// TestHeaderRetriesLikeRecv: a caller whose first call is Header gets
// the headers of the attempt that succeeds, as gRPC's Header retries.
func TestHeaderRetriesLikeRecv(t *testing.T) {
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

func (p *spanEnded) Shutdown(context.Context) error { return nil }

func (p *spanEnded) ForceFlush(context.Context) error { return nil }

// TestIdleStreamDeadlineNoRace: the deadline of a stream nobody
// reads from ends it on a goroutine of its own; under -race, the detector
// must stay quiet. The stream is bidi so that nothing (the generated code's
// SendMsg and CloseSend included) touches it after it opens, which would
// order its accesses by chance.
func TestIdleStreamDeadlineNoRace(t *testing.T) {
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

// TestSharedDeadlineReportsDeadlineExceeded: streams whose shared
// deadline passes while the server has not answered end with
// DeadlineExceeded, never Canceled.
func TestSharedDeadlineReportsDeadlineExceeded(t *testing.T) {
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
