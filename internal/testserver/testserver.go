// Package testserver runs grpc's TestService over bufconn for herdguard's
// tests, with a handler function per method that each test sets.
package testserver

import (
	"context"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
)

// Target is the client target that reaches the server.
const Target = "passthrough:///bufnet"

// Methods of the TestService.
const (
	MethodUnary = "/grpc.testing.TestService/UnaryCall"
	MethodEmpty = "/grpc.testing.TestService/EmptyCall"
)

type (
	// UnaryFunc handles UnaryCall.
	UnaryFunc = func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error)
	// EmptyFunc handles EmptyCall.
	EmptyFunc = func(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error)
	// ServerStreamFunc handles StreamingOutputCall.
	ServerStreamFunc = func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error
	// ClientStreamFunc handles StreamingInputCall.
	ClientStreamFunc = func(testgrpc.TestService_StreamingInputCallServer) error
	// BidiFunc handles FullDuplexCall.
	BidiFunc = func(testgrpc.TestService_FullDuplexCallServer) error
)

// Server is a TestService whose handlers the test sets before calling.
// Unset handlers answer Unimplemented.
type Server struct {
	testgrpc.UnimplementedTestServiceServer

	Unary        UnaryFunc
	Empty        EmptyFunc
	ServerStream ServerStreamFunc
	ClientStream ClientStreamFunc
	Bidi         BidiFunc

	// NoRecord turns off the recording of attempts (Attempts, Requests), so
	// that benchmarks measure gRPC and the interceptor alone.
	NoRecord bool

	lis *bufconn.Listener

	mu       sync.Mutex
	attempts []string // herdguard-attempt of every request seen, "" for none
}

// Start serves s on a bufconn listener until the test ends.
func Start(tb testing.TB, s *Server, opts ...grpc.ServerOption) *Server {
	tb.Helper()
	s.lis = bufconn.Listen(1 << 20)
	if !s.NoRecord {
		opts = append([]grpc.ServerOption{
			grpc.ChainUnaryInterceptor(s.recordUnary),
			grpc.ChainStreamInterceptor(s.recordStream),
		}, opts...)
	}
	srv := grpc.NewServer(opts...)
	testgrpc.RegisterTestServiceServer(srv, s)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(s.lis)
	}()
	tb.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return s
}

// Dial returns a client connection to s, closed when the test ends.
func (s *Server) Dial(tb testing.TB, opts ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	return s.DialTarget(tb, Target, opts...)
}

// DialTarget is Dial with the client target named target (a passthrough
// target reaches s whatever its name), so that one client can reach
// several servers under targets of their own.
func (s *Server) DialTarget(tb testing.TB, target string, opts ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	opts = append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return s.lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, opts...)
	cc, err := grpc.NewClient(target, opts...)
	if err != nil {
		tb.Fatalf("grpc.NewClient: %v", err)
	}
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Client returns a TestService client over a new connection.
func (s *Server) Client(tb testing.TB, opts ...grpc.DialOption) testgrpc.TestServiceClient {
	tb.Helper()
	return testgrpc.NewTestServiceClient(s.Dial(tb, opts...))
}

// Attempts returns the herdguard-attempt metadata of every request the
// server received, in arrival order ("" for a first attempt).
func (s *Server) Attempts() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.attempts...)
}

// Requests returns how many requests the server received.
func (s *Server) Requests() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.attempts)
}

func (s *Server) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	var n string
	if v := md.Get("herdguard-attempt"); len(v) > 0 {
		n = v[0]
	}
	s.mu.Lock()
	s.attempts = append(s.attempts, n)
	s.mu.Unlock()
}

func (s *Server) recordUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	s.record(ctx)
	return h(ctx, req)
}

func (s *Server) recordStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	s.record(ss.Context())
	return h(srv, ss)
}

// UnaryCall calls s.Unary.
func (s *Server) UnaryCall(ctx context.Context, r *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	if s.Unary == nil {
		return s.UnimplementedTestServiceServer.UnaryCall(ctx, r)
	}
	return s.Unary(ctx, r)
}

// EmptyCall calls s.Empty.
func (s *Server) EmptyCall(ctx context.Context, r *testgrpc.Empty) (*testgrpc.Empty, error) {
	if s.Empty == nil {
		return s.UnimplementedTestServiceServer.EmptyCall(ctx, r)
	}
	return s.Empty(ctx, r)
}

// StreamingOutputCall calls s.ServerStream.
func (s *Server) StreamingOutputCall(r *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
	if s.ServerStream == nil {
		return s.UnimplementedTestServiceServer.StreamingOutputCall(r, ss)
	}
	return s.ServerStream(r, ss)
}

// StreamingInputCall calls s.ClientStream.
func (s *Server) StreamingInputCall(ss testgrpc.TestService_StreamingInputCallServer) error {
	if s.ClientStream == nil {
		return s.UnimplementedTestServiceServer.StreamingInputCall(ss)
	}
	return s.ClientStream(ss)
}

// FullDuplexCall calls s.Bidi.
func (s *Server) FullDuplexCall(ss testgrpc.TestService_FullDuplexCallServer) error {
	if s.Bidi == nil {
		return s.UnimplementedTestServiceServer.FullDuplexCall(ss)
	}
	return s.Bidi(ss)
}
