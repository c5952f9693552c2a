package mesh

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/internal/wire"
)

// DialOptions returns the client half's interceptors, configured by opts,
// followed by ic's DialOptions, for the connections a server's handlers
// call through: grpc.NewClient(target, mesh.DialOptions(ic)...). The
// client half runs once per call, outside herdguard's retries, so that it
// sees how the call ended.
//
// ic must not be nil: DialOptions panics, saying so, when it is. The client
// half asks ic which codes its policy retries (Interceptor.Retries).
func DialOptions(ic *interceptor.Interceptor, opts ...Option) []grpc.DialOption {
	if ic == nil {
		panic("mesh: DialOptions: ic is nil; want the *interceptor.Interceptor the connection's calls go through")
	}
	opts = append(opts[:len(opts):len(opts)], withRetries(ic.Retries), withOverloaded(ic.Overloaded))
	return append([]grpc.DialOption{
		grpc.WithChainUnaryInterceptor(UnaryClientInterceptor(opts...)),
		grpc.WithChainStreamInterceptor(StreamClientInterceptor(opts...)),
	}, ic.DialOptions()...)
}

// UnaryClientInterceptor returns the client half for unary calls. It must
// run before (outside) herdguard's interceptor; DialOptions orders them.
//
// A call made while serving a request that is a retry, or that arrived with
// RetriesBelowKey "0", carries RetriesBelowKey "0" on; if the connection's
// overload controller paces the call's target (Interceptor.Overloaded:
// installed through DialOptions; without it the client half never knows),
// it is sent once (interceptor.NoRetry), and if it fails with a code the
// layer would have retried (herdguard's default retryable codes here; the
// connection's policy when installed through DialOptions), the request
// answers "don't retry" with OutcomeRetriedAbove. A target nobody judged
// overloaded gets the retries of every layer, as without the package. A
// call made while serving a request with a deadline is sent with that
// deadline less a reserve (WithDeadlineReserve). A call that gives up on
// evidence that retrying would hurt, or runs out of that time, makes the
// request answer "don't retry" (see package doc).
func UnaryClientInterceptor(opts ...Option) grpc.UnaryClientInterceptor {
	c := newConfig(opts)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		served := ctx
		limited := false
		if retriedAbove(ctx) {
			ctx = metadata.AppendToOutgoingContext(ctx, RetriesBelowKey, "0")
			if limited = c.overloadedAt(cc.Target()); limited {
				opts = append(opts[:len(opts):len(opts)], interceptor.NoRetry())
			}
		}
		ctx, cancel, cut := c.below(ctx)
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err != nil {
			err = c.gaveUp(served, cc.Target(), method, err, limited, cut && outOfTime(served, ctx, err))
		}
		if c.overloaded != nil { // installed through DialOptions: ic knows whether the target is paced
			c.heldBelow(served, cc.Target())
		}
		cancel()
		return err
	}
}

// heldBelow marks the answer to the request being served (ctx) as held
// back below (wire.HeldBelowKey) when the connection's overload controller
// paces target, the call's: the call waited in its line, and a herdguard
// client above would otherwise take that wait for a queue at its own
// target and hold its calls back too. It does nothing outside a gRPC
// server's handler, or while the controller is calm.
func (c config) heldBelow(ctx context.Context, target string) {
	if c.overloadedAt(target) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.HeldBelowKey, "1"))
	}
}

// gaveUp signals "don't retry" on the request being served if err says
// the call below (to method on target) gave up on evidence that retrying
// it from above would hurt (GaveUp) or ran out of the time the reserve
// left it (late), or, for a call limited to one attempt by a retry above,
// if its failure would have been retried (it was limited because the
// connection's overload controller paces target); it returns err, marked
// as signalled when it did. A give-up is named as it is, limited or not.
func (c config) gaveUp(ctx context.Context, target, method string, err error, limited, late bool) error {
	outcome, ok := GaveUp(err)
	switch {
	case late:
		signal(ctx, string(interceptor.OutcomeDeadline))
	case ok:
		signal(ctx, string(outcome))
	case limited && ctx.Err() == nil && c.retriesCode(method, status.Code(err)):
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
func StreamClientInterceptor(opts ...Option) grpc.StreamClientInterceptor {
	c := newConfig(opts)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		served := ctx
		limited := false
		if retriedAbove(ctx) {
			ctx = metadata.AppendToOutgoingContext(ctx, RetriesBelowKey, "0")
			if limited = c.overloadedAt(cc.Target()); limited {
				opts = append(opts[:len(opts):len(opts)], interceptor.NoRetry())
			}
		}
		ctx, cancel, cut := c.below(ctx)
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			err = c.gaveUp(served, cc.Target(), method, err, limited, cut && outOfTime(served, ctx, err))
			cancel()
			return nil, err
		}
		return &clientStream{ClientStream: cs, c: c, target: cc.Target(), method: method, served: served, call: ctx, cut: cut, cancel: cancel, limited: limited}, nil
	}
}

// clientStream watches a stream's errors for a give-up.
type clientStream struct {
	grpc.ClientStream
	c       config
	target  string
	method  string
	served  context.Context // the request being served, if any
	call    context.Context // the stream's own: served, or cut short by the reserve
	cut     bool
	cancel  context.CancelFunc // ends call once the stream has ended
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
	return s.c.gaveUp(s.served, s.target, s.method, err, s.limited && !s.received, s.cut && outOfTime(s.served, s.call, err))
}

func (s *clientStream) SendMsg(m any) error { return s.judge(s.ClientStream.SendMsg(m)) }

// RecvMsg judges the stream's end, then releases the reserve's context: a
// RecvMsg that fails has ended the stream.
func (s *clientStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil {
		s.mu.Lock()
		s.received = true
		s.mu.Unlock()
		return nil
	}
	err = s.judge(err)
	s.c.heldBelow(s.served, s.target) // the stream ended
	s.cancel()
	return err
}

func (s *clientStream) CloseSend() error { return s.judge(s.ClientStream.CloseSend()) }

func (s *clientStream) Header() (metadata.MD, error) {
	md, err := s.ClientStream.Header()
	return md, s.judge(err)
}
