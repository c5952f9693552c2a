package interceptor

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"fmt"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/testutil"
)

// callTimeout bounds every test call so a bug fails a test instead of
// hanging it.
const callTimeout = 10 * time.Second

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClock makes every wait instant: a timer fires at once, its
// function in its own goroutine, and moves the clock on by its duration.
// Delays returns every wait asked for; Advance moves the clock as time
// passing between calls.
type fakeClock struct{ *testutil.Clock }

func newFakeClock() *fakeClock {
	return &fakeClock{testutil.NewClock(time.Now(), testutil.Instant(), testutil.Async())}
}

// fixedRand returns the given numbers in turn, then repeats the last.
func fixedRand(rs ...float64) func() float64 {
	var mu sync.Mutex
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		r := rs[0]
		if len(rs) > 1 {
			rs = rs[1:]
		}
		return r
	}
}

// script answers the n-th request with the n-th error (nil: success); past
// the end it repeats the last. A trailer map, if any, is sent with the
// same-numbered answer.
type script struct {
	mu       sync.Mutex
	errs     []error
	trailers map[int]metadata.MD
	n        int
}

func fail(cs ...codes.Code) *script {
	s := &script{}
	for _, c := range cs {
		if c == codes.OK {
			s.errs = append(s.errs, nil)
		} else {
			s.errs = append(s.errs, status.Error(c, "scripted "+c.String()))
		}
	}
	return s
}

func (s *script) next(ctx context.Context) error {
	s.mu.Lock()
	i := s.n
	s.n++
	err := s.errs[min(i, len(s.errs)-1)]
	md := s.trailers[i]
	s.mu.Unlock()
	if md != nil {
		_ = grpc.SetTrailer(ctx, md)
	}
	return err
}

func (s *script) unary(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	if err := s.next(ctx); err != nil {
		return nil, err
	}
	return &testgrpc.SimpleResponse{Username: "ok"}, nil
}

func (s *script) empty(ctx context.Context, _ *testgrpc.Empty) (*testgrpc.Empty, error) {
	if err := s.next(ctx); err != nil {
		return nil, err
	}
	return &testgrpc.Empty{}, nil
}

// setup starts a server whose UnaryCall follows sc and returns a client
// through a new interceptor with the given options, a fake clock, and the
// interceptor.
func setup(t *testing.T, sc *script, opts ...Option) (*testserver.Server, testgrpc.TestServiceClient, *fakeClock, *Interceptor) {
	t.Helper()
	srv := testserver.Start(t, &testserver.Server{Unary: sc.unary, Empty: sc.empty})
	clk := newFakeClock()
	ic, err := New(append([]Option{withClock(clk), withRand(fixedRand(0.5))}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return srv, srv.Client(t, ic.DialOptions()...), clk, ic
}

func call(t *testing.T, c testgrpc.TestServiceClient, opts ...grpc.CallOption) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}, opts...)
	return err
}

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }

// alone returns the unary interceptor New makes with opts, and a client
// connection that never dials, for running the interceptor with an
// invoker of the test's own.
func alone(tb testing.TB, opts ...Option) (grpc.UnaryClientInterceptor, *grpc.ClientConn) {
	tb.Helper()
	ic, err := New(opts...)
	if err != nil {
		tb.Fatal(err)
	}
	cc, err := grpc.NewClient(testserver.Target, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cc.Close() })
	return ic.Unary(), cc
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
