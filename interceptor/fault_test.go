package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/policy"
)

// restartServer is a TestService on 127.0.0.1 that can be stopped and
// started again on the same address. Its first life answers nothing: every
// stream waits until the server stops. Its later lives answer every stream.
type restartServer struct {
	testgrpc.UnimplementedTestServiceServer
	addr    string
	reached atomic.Int64 // streams that reached the first life

	mu    sync.Mutex
	srv   *grpc.Server
	done  chan struct{}
	lives int
}

func (r *restartServer) start(t *testing.T) {
	t.Helper()
	addr := r.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var lis net.Listener
	var err error
	for range 100 { // the old listener's port may take a moment to free
		if lis, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	r.addr = lis.Addr().String()
	srv := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(srv, r)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	r.mu.Lock()
	r.srv, r.done = srv, done
	r.lives++
	r.mu.Unlock()
}

func (r *restartServer) stop() {
	r.mu.Lock()
	srv, done := r.srv, r.done
	r.mu.Unlock()
	srv.Stop()
	<-done
}

// firstLife reports whether the server is in its first life, and if so
// counts the stream and waits until the server stops.
func (r *restartServer) firstLife(ctx context.Context) bool {
	r.mu.Lock()
	first := r.lives == 1
	r.mu.Unlock()
	if first {
		r.reached.Add(1)
		<-ctx.Done()
	}
	return first
}

func (r *restartServer) FullDuplexCall(ss testgrpc.TestService_FullDuplexCallServer) error {
	if r.firstLife(ss.Context()) {
		return ss.Context().Err()
	}
	for {
		m, err := ss.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: m.GetPayload()}); err != nil {
			return err
		}
	}
}

func (r *restartServer) StreamingOutputCall(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
	if r.firstLife(ss.Context()) {
		return ss.Context().Err()
	}
	for i := range 3 {
		if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload(fmt.Sprint(i))}); err != nil {
			return err
		}
	}
	return nil
}

func (r *restartServer) StreamingInputCall(ss testgrpc.TestService_StreamingInputCallServer) error {
	if r.firstLife(ss.Context()) {
		return ss.Context().Err()
	}
	total := 0
	for {
		m, err := ss.Recv()
		if err == io.EOF {
			return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(total)})
		}
		if err != nil {
			return err
		}
		total += len(m.GetPayload().GetBody())
	}
}

// TestStreamsSurviveServerRestart opens 1000 streams of every kind, stops
// the server while their first attempts wait, and starts it again on the
// same address a little later, so that retries fail to reach it, fail to
// open, and at last open and replay. Beside them, 240 streams allowed two
// attempts end on a reopen that could not open: the server stays down until
// they have. Every stream must end before its deadline, with every message
// exactly once if it succeeded; no method may panic on a stream that ended
// (a failed reopen once left the stream without an attempt), and no
// goroutine may be left (TestMain).
func TestStreamsSurviveServerRestart(t *testing.T) {
	const (
		streams  = 1000
		short    = 240 // streams allowed two attempts, whose second cannot open
		deadline = 20 * time.Second
		margin   = 5 * time.Second
		downtime = 150 * time.Millisecond
	)
	srv := &restartServer{}
	srv.start(t)
	t.Cleanup(srv.stop)

	connect := grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{
		BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, MaxDelay: 50 * time.Millisecond,
	}, MinConnectTimeout: time.Second})
	client := func(ic *Interceptor) testgrpc.TestServiceClient {
		cc, err := grpc.NewClient(srv.addr, append(ic.DialOptions(),
			grpc.WithTransportCredentials(insecure.NewCredentials()), connect)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return testgrpc.NewTestServiceClient(cc)
	}
	rec, mp := newMetrics()
	ic, err := New(WithoutBreaker(), WithMeterProvider(mp), WithPolicy(policy.Policy{
		MaxAttempts: 20, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}))
	if err != nil {
		t.Fatal(err)
	}
	c := client(ic)
	// The short streams retry at once, unpaced, so that the retry of every
	// one of them meets the stopped server.
	shortIC, err := New(WithoutBreaker(), WithoutOverloadControl(), WithPolicy(policy.Policy{
		MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, Jitter: policy.NoJitter,
	}))
	if err != nil {
		t.Fatal(err)
	}
	shortC := client(shortIC)

	results := make(chan restartResult, streams)
	shortResults := make(chan restartResult, short)
	var wg, shortWG sync.WaitGroup
	for i := range streams {
		wg.Go(func() { results <- streamThroughRestart(c, i, deadline) })
	}
	for i := range short {
		shortWG.Go(func() { shortResults <- streamThroughRestart(shortC, i, deadline) })
	}

	// Stop the server once every stream's first attempt waits in it.
	wait, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	for srv.reached.Load() < streams+short {
		if wait.Err() != nil {
			t.Fatalf("only %d of %d streams reached the server", srv.reached.Load(), streams+short)
		}
		time.Sleep(5 * time.Millisecond)
	}
	srv.stop()
	shortDone := make(chan struct{})
	go func() { shortWG.Wait(); close(shortDone) }()
	select {
	case <-shortDone: // every short stream's reopen met the stopped server
	case <-time.After(deadline + margin):
		t.Fatal("short streams still running past their deadline")
	}
	time.Sleep(downtime) // the retries meanwhile find no server
	srv.start(t)

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(deadline + margin):
		t.Fatal("streams still running past their deadline")
	}
	close(results)
	close(shortResults)
	ok, codesSeen := 0, map[codes.Code]int{}
	for r := range results {
		if r.late > margin {
			t.Errorf("a %s stream ended %v past its deadline", r.kind, r.late)
		}
		if r.err == nil {
			ok++
			continue
		}
		codesSeen[status.Code(r.err)]++
		var re *RetryError
		if status.Code(r.err) != codes.Unavailable || !errors.As(r.err, &re) {
			t.Errorf("a %s stream failed with %v; want success, or a RetryError with Unavailable once its retries ran out", r.kind, r.err)
		}
	}
	for r := range shortResults {
		var re *RetryError
		if status.Code(r.err) != codes.Unavailable || !errors.As(r.err, &re) || re.Attempts != 2 {
			t.Errorf("a short %s stream ended with %v; want a RetryError with Unavailable after 2 attempts, the second made while the server was down", r.kind, r.err)
		}
	}
	failed := sumInt(t, rec, telemetry.MetricAttempts, []attribute.KeyValue{semconv.RPCResponseStatusCode("UNAVAILABLE")})
	t.Logf("%d of %d streams succeeded after the restart; failures by code: %v; %d attempts failed Unavailable",
		ok, streams, codesSeen, failed)
	if failed <= streams {
		t.Errorf("%d attempts failed Unavailable: the retries never met the stopped server, so the test tested no reopen", failed)
	}
	if ok < streams/2 {
		t.Errorf("%d of %d streams succeeded; with 20 attempts most should outlive a %v restart", ok, streams, downtime)
	}
}

// restartResult is how a stream of TestStreamsSurviveServerRestart ended.
type restartResult struct {
	kind string
	err  error
	late time.Duration // past the deadline when the stream ended
}

// streamThroughRestart runs stream i (of the kind i picks) on c with the
// given deadline, then calls every method of the ended stream, which must
// answer.
func streamThroughRestart(c testgrpc.TestServiceClient, i int, deadline time.Duration) restartResult {
	words := []string{"a", "bb", "ccc"}
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	due, _ := ctx.Deadline()
	var (
		cs   grpc.ClientStream
		kind string
		err  error
	)
	switch i % 3 {
	case 0:
		kind = "bidi"
		err = func() error {
			s, err := c.FullDuplexCall(ctx)
			if err != nil {
				return err
			}
			cs = s
			for _, w := range words {
				if err := s.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload(w)}); err != nil && err != io.EOF {
					return err
				}
			}
			_ = s.CloseSend()
			got, err := recvAll(s.Recv)
			if err == nil && !slices.Equal(got, words) {
				return fmt.Errorf("echoed %q, want %q once each", got, words)
			}
			return err
		}()
	case 1:
		kind = "server"
		err = func() error {
			s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
			if err != nil {
				return err
			}
			cs = s
			got, err := recvAll(s.Recv)
			if want := []string{"0", "1", "2"}; err == nil && !slices.Equal(got, want) {
				return fmt.Errorf("received %q, want %q once each", got, want)
			}
			return err
		}()
	default:
		kind = "client"
		err = func() error {
			s, err := c.StreamingInputCall(ctx)
			if err != nil {
				return err
			}
			cs = s
			for _, w := range words {
				if err := s.Send(&testgrpc.StreamingInputCallRequest{Payload: payload(w)}); err != nil && err != io.EOF {
					return err
				}
			}
			resp, err := s.CloseAndRecv()
			if err == nil && resp.GetAggregatedPayloadSize() != 6 {
				return fmt.Errorf("server read %d bytes, want 6", resp.GetAggregatedPayloadSize())
			}
			return err
		}()
	}
	if cs != nil { // every method of an ended stream must answer
		cs.Trailer()
		_, _ = cs.Header()
		_ = cs.Context()
		_ = cs.CloseSend()
		_ = cs.SendMsg(&testgrpc.StreamingOutputCallRequest{})
		_ = cs.RecvMsg(&testgrpc.StreamingOutputCallResponse{})
	}
	return restartResult{kind: kind, err: err, late: time.Since(due)}
}
