package interceptor

import (
	"context"
	"io"
	"slices"
	"sync"
	"testing"

	"fmt"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

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

// TestLaterInterceptorsSeeCallerMessages: an interceptor chained
// after herdguard's sees the caller's own message type, on the first send
// and on every replay, with the same content in the same order.
func TestLaterInterceptorsSeeCallerMessages(t *testing.T) {
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

// TestNilClientConn: an interceptor called directly, with no
// connection (as tests and benchmarks call invokers), must not panic on the
// missing target: it runs with the target "".
func TestNilClientConn(t *testing.T) {
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

// TestLaterInterceptorAppendsOption: an interceptor chained after
// herdguard may append to the call options it is given (many add
// WaitForReady, or a per-call credential). The options herdguard passes
// come from a pooled buffer, which also holds the catchers the next call
// uses to see response headers (gRFC A6's commit rule); an append must
// not write over them. Each round makes a call that may not be retried
// (its one attempt carries no catchers), then a call whose server sends
// headers before it fails: that call is committed, one attempt.
func TestLaterInterceptorAppendsOption(t *testing.T) {
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

// TestAttemptsDoNotMultiplyWithGRPCRetry: with gRPC's own retry also
// configured, a call makes herdguard's attempts, not herdguard's times
// gRPC's.
func TestAttemptsDoNotMultiplyWithGRPCRetry(t *testing.T) {
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
