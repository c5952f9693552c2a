package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// DefaultStreamBuffer is how many bytes of sent messages a stream keeps for
// replay until it commits: 256 KiB, as gRPC's own retry keeps.
const DefaultStreamBuffer = 256 << 10

// errAttemptTimeout is the cause with which a stream attempt's context is
// cancelled when its PerAttemptTimeout passes before the stream commits.
var errAttemptTimeout = errors.New("herdguard: per-attempt timeout")

// Stream returns the stream client interceptor. Every stream kind is
// retried as gRFC A6 describes: opening the stream, and any failure with a
// retryable code before the stream commits, starts a new attempt that
// replays, in order, the messages sent so far and CloseSend. A stream
// commits when the caller receives response headers or a response message,
// or when its replay buffer overflows; after that an error reaches the
// caller as it is. The caller never sees a message twice.
func (ic *Interceptor) Stream() grpc.StreamClientInterceptor { return ic.stream }

// retryStream is one logical stream: a series of attempts, each a stream
// from the next streamer, of which the last is current.
type retryStream struct {
	ic       *Interceptor
	p        *resolved
	tracer   trace.Tracer
	span     trace.Span // the call span, nil when tracing is off
	ctx      context.Context
	desc     *grpc.StreamDesc
	cc       *grpc.ClientConn
	method   string
	streamer grpc.Streamer
	opts     []grpc.CallOption
	limit    int
	done     func(herdguard.Verdict) // the breaker's, nil without one
	probe    bool
	// breaker is the stream's breaker (nil without one) and breakerState its
	// state as last seen, to record its changes as span events.
	breaker      *breaker.Breaker
	breakerState breaker.State
	unwatch      func() bool // stops watching the caller's context
	// cancelTimeout releases the context of the policy's Timeout, if any.
	cancelTimeout context.CancelFunc

	maxAttempts int

	// mu guards the fields below. It is held while a new attempt starts and
	// replays, and during the wait before it, so sends wait for the new
	// attempt; it is never held while an attempt's SendMsg or RecvMsg runs.
	mu         sync.Mutex
	a          *streamAttempt
	attempts   int
	bs         backoffState
	committed  bool
	overflow   bool
	buf        []buffered
	bufBytes   int
	closeSent  bool
	finished   bool
	outcome    Outcome
	sent       int64
	received   int64
	replayed   int64
	replayedSz int64
}

// buffered is a sent message kept for replay: gRPC's own encoding of it,
// so a replay sends the same bytes without encoding again. It is kept by
// value, one allocation less per message; SendMsg gets a pointer into the
// buffer, which stays valid if the buffer grows.
type buffered struct {
	msg  grpc.PreparedMsg
	size int
}

// streamAttempt is one attempt of a stream.
type streamAttempt struct {
	n        int
	cs       grpc.ClientStream // nil when the attempt failed to open
	cancel   context.CancelCauseFunc
	timeout  *time.Timer // cancels the attempt at PerAttemptTimeout until commit
	timedOut atomic.Bool
	span     trace.Span
	ended    bool // its span is ended and it is counted; guarded by mu
}

var _ grpc.ClientStream = (*retryStream)(nil)

func (ic *Interceptor) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	p, noRetry, err := ic.policyFor(method, opts)
	limit, lerr := streamBufferFor(ic.streamBuffer, opts)
	if err == nil {
		err = lerr
	}
	s := &retryStream{ic: ic, p: p, tracer: ic.tracing.tracer(), desc: desc, cc: cc, method: method,
		streamer: streamer, opts: opts, limit: limit}
	if s.tracer != nil {
		ctx, s.span = startCall(ctx, s.tracer, method)
	}
	s.ctx = ctx
	if err != nil {
		err = status.Error(codes.InvalidArgument, err.Error())
		s.outcome = OutcomeInvalidCallOption
		s.endSpan(err)
		if m := ic.metering.get(); m != nil {
			m.call(ctx, method, s.outcome)
		}
		return nil, err
	}
	if d := p.p.Timeout; d > 0 {
		ctx, s.cancelTimeout = context.WithTimeout(ctx, d)
		s.ctx = ctx
	}
	s.maxAttempts = p.p.MaxAttempts
	if noRetry {
		s.maxAttempts = 1
	}
	if ic.breakers != nil {
		b := ic.breakers.Get(cc.Target(), method)
		s.breaker, s.breakerState = b, b.LastState()
		done, probe, err := b.Allow(ctx)
		if err != nil {
			var oe *breaker.OpenError
			if s.span != nil && errors.As(err, &oe) {
				breakerRejected(s.span, oe)
			}
			s.outcome = OutcomeBreakerOpen
			if s.cancelTimeout != nil {
				s.cancelTimeout()
			}
			s.endSpan(err)
			if m := ic.metering.get(); m != nil {
				m.call(ctx, method, s.outcome)
			}
			return nil, err
		}
		s.done, s.probe = done, probe
		if probe {
			s.maxAttempts = 1
		}
		s.breakerChanged() // admission may have moved an open breaker to half-open
	}
	s.bs.method, s.bs.lim, s.bs.meter = method, ic.limitsFor(cc.Target()), ic.metering.get()
	s.bs.unsafe = ic.idempotentOnly && !ic.safeToRetry(method)
	s.ctx = ic.withIdempotencyKey(s.ctx)
	s.bs.started()
	s.mu.Lock()
	err = s.retryLocked(nil)
	s.mu.Unlock()
	if err != nil {
		s.finish(err)
		return nil, err
	}
	s.unwatch = context.AfterFunc(ctx, func() { s.finish(status.FromContextError(ctx.Err()).Err()) })
	return s, nil
}

// retryLocked starts the next attempt, after the current one (if any)
// failed with err, and replays into it what the caller sent. It returns nil
// once an attempt runs, or the stream's final error.
func (s *retryStream) retryLocked(err error) error {
	for {
		if a := s.a; a != nil {
			timedOut := a.timedOut.Load()
			if timedOut {
				err = status.Error(codes.DeadlineExceeded, errAttemptTimeout.Error())
			}
			var trailer metadata.MD
			if a.cs != nil {
				trailer = a.cs.Trailer()
			}
			s.endAttempt(a, err)
			a.release()
			// an attempt that failed to open never reached the server
			d := s.ic.decide(s.ctx, s.p, &s.bs, a.n, s.maxAttempts, err, timedOut, trailer, a.cs != nil)
			if !d.retry {
				s.outcome = d.outcome
				return d.err
			}
			if perr := s.ic.pause(s.ctx, s.tracer, &s.bs, a.n+1, d); perr != nil {
				s.outcome = contextOutcome(s.ctx.Err())
				return perr
			}
		}
		if err = s.startLocked(); err == nil {
			return nil
		}
	}
}

// startLocked opens a new attempt and replays the buffer into it.
func (s *retryStream) startLocked() error {
	s.attempts++
	a := &streamAttempt{n: s.attempts}
	s.a = a
	ctx := s.ctx
	if a.n > 1 {
		ctx = metadata.AppendToOutgoingContext(ctx, AttemptMetadataKey, attemptValue(a.n)[0])
	}
	ctx, a.cancel = context.WithCancelCause(ctx)
	if d := s.p.p.PerAttemptTimeout; d > 0 {
		a.timeout = time.AfterFunc(d, func() {
			a.timedOut.Store(true)
			a.cancel(errAttemptTimeout)
		})
	}
	if s.tracer != nil {
		ctx, a.span = startAttempt(ctx, s.tracer, a.n)
	}
	cs, err := s.streamer(ctx, s.desc, s.cc, s.method, s.opts...)
	if err != nil {
		return err
	}
	a.cs = cs
	for i := range s.buf {
		b := &s.buf[i]
		if err := cs.SendMsg(&b.msg); err != nil {
			if err == io.EOF {
				return nil // the attempt broke; RecvMsg will learn how
			}
			return err
		}
		s.replayed++
		s.replayedSz += int64(b.size)
	}
	if s.closeSent {
		return cs.CloseSend()
	}
	return nil
}

// release stops an attempt's timeout and cancels its context, freeing what
// gRPC holds for it. Its trailer stays readable.
func (a *streamAttempt) release() {
	if a.timeout != nil {
		a.timeout.Stop()
	}
	a.cancel(nil)
}

// commitLocked makes the current attempt final: no more retries, no more
// buffering, no per-attempt timeout.
func (s *retryStream) commitLocked(overflow bool) {
	if s.committed {
		return
	}
	s.committed, s.overflow = true, overflow
	s.buf, s.bufBytes = nil, 0
	if t := s.a.timeout; t != nil {
		t.Stop()
	}
}

func (s *retryStream) current() *streamAttempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.a
}

// SendMsg sends m on the current attempt and, until the stream commits,
// keeps an encoded copy of it for replay.
func (s *retryStream) SendMsg(m any) error {
	s.mu.Lock()
	a := s.a
	s.sent++
	if s.committed {
		s.mu.Unlock()
		return a.cs.SendMsg(m)
	}
	size, known := encodedSize(m)
	if !known || s.bufBytes+size > s.limit {
		s.commitLocked(true)
		s.mu.Unlock()
		return a.cs.SendMsg(m)
	}
	s.buf = append(s.buf, buffered{size: size})
	pm := &s.buf[len(s.buf)-1].msg
	if err := pm.Encode(a.cs, m); err != nil {
		s.buf = s.buf[:len(s.buf)-1]
		s.mu.Unlock()
		return err
	}
	s.bufBytes += size
	s.mu.Unlock()
	err := a.cs.SendMsg(pm)
	if err == io.EOF {
		// The attempt broke. Until the stream commits the message stays
		// buffered and is replayed if the stream is retried; either way
		// RecvMsg reports how the stream ended.
		s.mu.Lock()
		committed := s.committed
		s.mu.Unlock()
		if !committed {
			return nil
		}
	}
	return err
}

// RecvMsg receives from the current attempt, retrying the stream on a
// retryable failure before it commits. The first message commits it.
func (s *retryStream) RecvMsg(m any) error {
	for {
		a := s.current()
		err := a.cs.RecvMsg(m)
		s.mu.Lock()
		switch {
		case err == nil:
			s.received++
			if s.a == a {
				s.commitLocked(false)
			}
			s.mu.Unlock()
			if !s.desc.ServerStreams {
				s.finish(nil) // a single response ends the stream
			}
			return nil
		case s.a != a:
			s.mu.Unlock() // another goroutine already moved to a new attempt
			continue
		case err == io.EOF:
			s.commitLocked(false)
			s.mu.Unlock()
			s.finish(nil)
			return io.EOF
		case s.committed || s.finished:
			s.mu.Unlock()
			s.finish(err)
			return err
		}
		rerr := s.retryLocked(err)
		s.mu.Unlock()
		if rerr != nil {
			s.finish(rerr)
			return rerr
		}
	}
}

// Header returns the current attempt's response headers; receiving them
// commits the stream. Like gRPC's, it returns no error for a stream that
// ended without headers: RecvMsg reports how it ended.
func (s *retryStream) Header() (metadata.MD, error) {
	a := s.current()
	md, err := a.cs.Header()
	if md != nil && err == nil {
		s.mu.Lock()
		if s.a == a {
			s.commitLocked(false)
		}
		s.mu.Unlock()
	}
	return md, err
}

// Trailer returns the current attempt's trailer.
func (s *retryStream) Trailer() metadata.MD { return s.current().cs.Trailer() }

// CloseSend closes the sending side of the current attempt and of every
// attempt after it.
func (s *retryStream) CloseSend() error {
	s.mu.Lock()
	s.closeSent = true
	a := s.a
	s.mu.Unlock()
	return a.cs.CloseSend()
}

// Context returns the current attempt's context.
func (s *retryStream) Context() context.Context { return s.current().cs.Context() }

// finish records the stream's final status once: for the breaker, on the
// span, and by releasing the buffer and the attempt's timer.
func (s *retryStream) finish(err error) {
	s.mu.Lock()
	if s.finished {
		s.mu.Unlock()
		return
	}
	s.finished = true
	a := s.a
	s.buf, s.bufBytes = nil, 0
	if s.outcome == "" {
		switch {
		case err == nil:
			s.outcome = OutcomeOK
		case s.ctx.Err() != nil:
			s.outcome = contextOutcome(s.ctx.Err())
		case s.committed:
			s.outcome = OutcomeFailedAfterCommit
		default:
			s.outcome = OutcomeNotRetryable
		}
	}
	if a != nil {
		s.endAttempt(a, err)
	}
	s.mu.Unlock()

	if s.unwatch != nil {
		s.unwatch()
	}
	if s.cancelTimeout != nil {
		defer s.cancelTimeout()
	}
	if a != nil {
		a.release() // the stream is over
	}
	if err == nil {
		s.bs.succeeded()
	}
	if s.done != nil {
		s.done(verdict(s.ctx, err)) // counted when it returns
		s.breakerChanged()
	}
	s.endSpan(err)
	if s.bs.meter != nil {
		s.bs.meter.call(s.ctx, s.method, s.outcome)
	}
}

// breakerChanged records a change of the breaker's state since it was last
// seen as an event on the call span.
func (s *retryStream) breakerChanged() {
	if s.span == nil || s.breaker == nil {
		return
	}
	if now := s.breaker.LastState(); now != s.breakerState {
		breakerChanged(s.span, s.breaker.Scope(), s.breakerState, now)
		s.breakerState = now
	}
}

// endAttempt ends an attempt's span and counts it, once.
func (s *retryStream) endAttempt(a *streamAttempt, err error) {
	if a.ended {
		return
	}
	a.ended = true
	if s.bs.meter != nil {
		s.bs.meter.attempt(s.ctx, s.method, status.Code(err), a.n > 1)
	}
	if a.span != nil {
		st := status.Convert(err)
		endAttempt(a.span, st.Code(), st.Message())
	}
}

func (s *retryStream) endSpan(err error) {
	if s.span == nil {
		return
	}
	s.mu.Lock()
	s.span.SetAttributes(
		AttrStreamSent.Int64(s.sent),
		AttrStreamReceived.Int64(s.received),
		AttrStreamReplayedMessages.Int64(s.replayed),
		AttrStreamReplayedBytes.Int64(s.replayedSz),
		AttrStreamOverflow.Bool(s.overflow),
	)
	if s.probe {
		s.span.SetAttributes(AttrBreakerProbe.Bool(true))
	}
	attempts, outcome := s.attempts, s.outcome
	s.mu.Unlock()
	st := status.Convert(err)
	endCall(s.span, attempts, outcome, st.Code(), st.Message())
}

// encodedSize is m's size on the wire before compression. Only protobuf
// messages can be sized; known is false for others.
func encodedSize(m any) (size int, known bool) {
	if pm, ok := m.(proto.Message); ok {
		return proto.Size(pm), true
	}
	return 0, false
}

// streamBufferFor returns the replay buffer limit of a call.
func streamBufferFor(def int, opts []grpc.CallOption) (int, error) {
	for _, o := range opts {
		if o, ok := o.(streamBufferOption); ok {
			if o.n < 0 {
				return 0, fmt.Errorf("interceptor: CallStreamBuffer(%d): must not be negative", o.n)
			}
			def = o.n
		}
	}
	return def, nil
}
