package mesh

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/herdguard/herdguard/interceptor"
)

// DialOptions returns the client half's interceptors followed by ic's
// DialOptions, for the connections a server's handlers call through:
// grpc.NewClient(target, mesh.DialOptions(ic)...). The client half runs
// once per call, outside herdguard's retries, so that it sees how the call
// ended.
func DialOptions(ic *interceptor.Interceptor) []grpc.DialOption {
	return append([]grpc.DialOption{
		grpc.WithChainUnaryInterceptor(UnaryClientInterceptor()),
		grpc.WithChainStreamInterceptor(StreamClientInterceptor()),
	}, ic.DialOptions()...)
}

// UnaryClientInterceptor returns the client half for unary calls. It must
// run before (outside) herdguard's interceptor; DialOptions orders them.
//
// A call made while serving a request that is a retry, or that arrived with
// RetriesBelowKey "0", is sent once (interceptor.NoRetry) and carries
// RetriesBelowKey "0" on. A call that gives up makes the request answer
// "don't retry" (see package doc).
func UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		limited := retriedAbove(ctx)
		if limited {
			ctx = metadata.AppendToOutgoingContext(ctx, RetriesBelowKey, "0")
			opts = append(opts[:len(opts):len(opts)], interceptor.NoRetry())
		}
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err != nil {
			err = gaveUp(ctx, err, limited)
		}
		return err
	}
}

// gaveUp signals "don't retry" on the request being served if err says
// the call below gave up, or, for a call limited to one attempt by a retry
// above, if its failure would have been retried; it returns err, marked as
// signalled when it did.
func gaveUp(ctx context.Context, err error, limited bool) error {
	outcome, ok := GaveUp(err)
	switch {
	case ok && !limited:
		signal(ctx, string(outcome))
	case limited && retryableAbove(ctx, err):
		signal(ctx, OutcomeRetriedAbove)
	default:
		return err
	}
	return signalled{err}
}

// StreamClientInterceptor returns the client half for streams; see
// UnaryClientInterceptor. A stream limited to one attempt that fails after
// it has received a message is not counted as given up: it had committed,
// and herdguard would not have retried it either.
func StreamClientInterceptor() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		limited := retriedAbove(ctx)
		if limited {
			ctx = metadata.AppendToOutgoingContext(ctx, RetriesBelowKey, "0")
			opts = append(opts[:len(opts):len(opts)], interceptor.NoRetry())
		}
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			return nil, gaveUp(ctx, err, limited)
		}
		return &clientStream{ClientStream: cs, served: ctx, limited: limited}, nil
	}
}

// clientStream watches a stream's errors for a give-up.
type clientStream struct {
	grpc.ClientStream
	served  context.Context // the request being served, if any
	limited bool

	mu       sync.Mutex
	received bool // a message arrived: a limited stream has committed
	done     bool // an error was judged
}

func (s *clientStream) judge(err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return err
	}
	s.done = true
	return gaveUp(s.served, err, s.limited && !s.received)
}

func (s *clientStream) SendMsg(m any) error { return s.judge(s.ClientStream.SendMsg(m)) }

func (s *clientStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil {
		s.mu.Lock()
		s.received = true
		s.mu.Unlock()
		return nil
	}
	return s.judge(err)
}

func (s *clientStream) CloseSend() error { return s.judge(s.ClientStream.CloseSend()) }

func (s *clientStream) Header() (metadata.MD, error) {
	md, err := s.ClientStream.Header()
	return md, s.judge(err)
}
