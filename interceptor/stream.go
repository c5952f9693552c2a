package interceptor

import (
	"context"
	"errors"
	"io"
	"sync"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// Stream returns the stream client interceptor. Every stream kind is
// retried as gRFC A6 describes: opening the stream, and any failure with a
// retryable code before the stream commits, starts a new attempt that
// replays, in order, the messages sent so far and CloseSend. A stream
// commits when the server's response headers or a message reach it, when
// the caller calls Context, or when its replay buffer overflows; after that
// an error reaches the caller as it is. The caller never sees a message
// twice. What is retried, and the waits, are as for [Interceptor.Unary].
// A layer below's give-up (package mesh) that fails the stream before it
// commits makes it give up as a unary call does; one that fails it after
// reaches the caller as the server's status, as any error after commit,
// and neither the breaker nor the overload controller counts it (its
// trailer is read once RecvMsg has reported the end).
//
// The replay buffer holds 256 KiB of encoded messages ([WithStreamBuffer],
// [CallStreamBuffer]). SendMsg, RecvMsg and Header all drive a retry when
// they find the attempt broken, through one funnel, as gRPC's own stream
// does. Interceptors chained after herdguard's see the caller's messages;
// the buffer keeps each message encoded, and a replay sends a new message
// of the caller's type decoded from it. Hedged streams replay their
// messages to each hedge and commit as retried streams do; no hedge starts
// once the replay buffer overflowed.
func (ic *Interceptor) Stream() grpc.StreamClientInterceptor { return ic.stream }

// clientStream is one logical stream: a series of attempts, each a stream
// from the next streamer, of which the last is current. A retried stream
// runs one attempt at a time; a hedged one holds its hedging strategy
// (streamHedging), which runs several until the stream commits, and then
// runs as a retried one.
//
// Every operation goes through one funnel, as grpc-go's clientStream does:
// until the stream commits, the operation runs against the current attempt
// outside the lock, and its result is judged under the lock. If the attempt
// broke, retryLocked decides, waits, and opens and replays the next one, and
// the operation runs again there; if another goroutine moved to a new
// attempt meanwhile, the operation simply runs again on that one. The
// current attempt is never nil, so no operation can find the stream without
// one: an attempt that failed to open stays current (with no ClientStream)
// once the stream has ended.
type clientStream struct {
	ic       *Interceptor
	p        *resolved
	tracer   trace.Tracer
	span     trace.Span // the call span, nil when tracing is off
	ctx      context.Context
	desc     *grpc.StreamDesc
	cc       *grpc.ClientConn
	method   string
	onFinish []func(error) // the caller's grpc.OnFinish, run once at the end
	streamer grpc.Streamer
	opts     []grpc.CallOption
	limit    int
	probe    bool
	// back puts the next attempt at the back of the overload controller's
	// line (see inLine); ctl is the target's controller (nil: off).
	back    bool
	ctl     *pacing.Controller
	skipped decision // the backoff wait a retry in line skipped
	// breaker is the stream's breaker (nil without one).
	breaker *breaker.Breaker
	// cancelTimeout releases the context of the policy's Timeout, if any.
	cancelTimeout context.CancelFunc

	maxAttempts int
	// hedged runs a hedged stream's attempts until it commits; nil for a
	// stream that is retried. Its methods that the end of a stream calls
	// do nothing when it is nil.
	hedged *streamHedging

	// mu guards the fields below. It is held while the stream decides on a
	// retry, waits before it, and opens and replays the next attempt, so
	// that every operation waits for the new attempt (a hedge, which runs
	// beside others, opens without it); it is never held while the
	// caller's SendMsg or RecvMsg runs on an attempt.
	mu           sync.Mutex
	a            *streamAttempt
	attempts     int
	numbers      retryNumbers
	bs           backoffState
	waitTimer    clock.Timer // bs.timer: the backoff's timer, made on the first wait
	state        streamState
	answered     bool // the server answered the current attempt (headers, a message, or an OK end)
	overflow     bool // the replay buffer overflowed, which committed the stream
	closeSent    bool
	err          error // the final error once ended; nil: ended OK
	outcome      Outcome
	notInFlight  bool          // the deadline ran out while no attempt was in flight
	gaveUpBelow  bool          // it stopped on a "do not retry" from a layer below that gave up (the herdguard-gave-up trailer)
	breakerState breaker.State // as last seen, to record changes as span events; beside the bools, so that the stream fits its size class
	// breakerDone hears the stream's verdict, once: when the server first
	// answers, or when the stream ends. nil without a breaker or once told.
	breakerDone func(herdguard.Verdict)
	unwatch     func() bool // stops watching the caller's context
	// ended is done once the stream's end is recorded (the call span
	// ended, the call counted). A goroutine that finds the stream ended by
	// another, as when the caller's context ends and the watcher ends it,
	// waits for it before it reports the end to the caller, as gRPC's own
	// stream records its end before RecvMsg returns it.
	ended sync.WaitGroup

	replay replayBuffer // every message sent before commit

	sent, received, replayed, replayedSz int64
}

var _ grpc.ClientStream = (*clientStream)(nil)

// streamState is where a stream is in its life. It only moves forward:
//
//	open ──commit──▶ committed ──end──▶ done
//	  └──────────────────end──────────▶ ended
//
// A stream commits to its current attempt when the server answers it,
// when the caller takes its Context or Trailer, or when the replay buffer
// overflows; it ends once its final status is recorded (for the breaker,
// the overload controller, the span and the metrics).
type streamState uint8

const (
	// streamOpen: a failed attempt may be retried, and what the caller
	// sends is kept for replay.
	streamOpen streamState = iota
	// streamCommitted: the stream is its current attempt's, whose errors
	// reach the caller as they are.
	streamCommitted
	// streamEnded: ended before it committed; every operation reports its
	// final status.
	streamEnded
	// streamDone: ended after it committed; the caller still reads the
	// attempt to its end.
	streamDone
)

func (st streamState) isOpen() bool      { return st == streamOpen }
func (st streamState) isCommitted() bool { return st == streamCommitted || st == streamDone }
func (st streamState) isEnded() bool     { return st >= streamEnded }

// end is the state a stream in st moves to when it ends.
func (st streamState) end() streamState {
	if st.isCommitted() {
		return streamDone
	}
	return streamEnded
}

func (ic *Interceptor) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	p, noRetry, err := ic.policyFor(method, opts)
	limit, lerr := streamBufferFor(ic.streamBuffer, opts)
	if err == nil {
		err = lerr
	}
	opts, finish := splitOnFinish(opts)
	target := targetOf(cc)
	s := &clientStream{ic: ic, p: p, tracer: ic.tracing.tracer(), desc: desc, cc: cc, method: method,
		streamer: streamer, opts: opts, limit: limit, onFinish: finish}
	s.ended.Add(1)
	if s.tracer != nil {
		ctx, s.span = startCall(ctx, s.tracer, method, target)
	}
	s.ctx = ctx
	if err != nil {
		err = status.Error(codes.InvalidArgument, err.Error())
		s.outcome = OutcomeInvalidCallOption
		s.endSpan(err)
		ic.metering.call(ctx, method, target, s.outcome)
		if err != nil && ic.events.on {
			ic.gaveUp(ctx, method, target, s.outcome, 0, err)
		}
		finished(finish, err)
		return nil, err
	}
	if d := p.p.Timeout; d > 0 {
		ctx, s.cancelTimeout = context.WithTimeout(ctx, d)
		s.ctx = ctx
	}
	s.maxAttempts = p.p.MaxAttempts
	if p.hedged() {
		s.maxAttempts = p.p.Hedging.MaxAttempts
	}
	if noRetry {
		s.maxAttempts = 1
	}
	if ic.breakers != nil {
		b := ic.breakers.Get(target, method)
		s.breaker, s.breakerState = b, b.LastState()
		done, probe, err := b.Allow()
		if err != nil {
			var oe *breaker.OpenError
			if s.span != nil && errors.As(err, &oe) {
				breakerRejected(s.span, oe)
			}
			s.outcome = refusalOutcome(err)
			if s.cancelTimeout != nil {
				s.cancelTimeout()
			}
			s.endSpan(err)
			ic.metering.call(ctx, method, target, s.outcome)
			if err != nil && ic.events.on {
				ic.gaveUp(ctx, method, target, s.outcome, 0, err)
			}
			finished(finish, err)
			return nil, err
		}
		s.breakerDone, s.probe = done, probe
		if probe {
			s.maxAttempts = 1
		}
		s.breakerChangedLocked() // admission may have moved an open breaker to half-open
	}
	s.bs.method, s.bs.target, s.bs.lim, s.bs.timer = method, target, ic.limitsFor(target), &s.waitTimer
	s.ctl = ic.controllerFor(target)
	s.bs.ctl = s.ctl
	s.bs.unsafe = ic.idempotentOnly && !ic.safeToRetry(method)
	s.ctx = ic.withIdempotencyKey(s.ctx)
	if p.hedged() {
		if s.bs.unsafe {
			s.maxAttempts = 1 // WithIdempotentOnly: only idempotent methods are hedged
		}
		if s.maxAttempts > 1 {
			return s.startHedged()
		}
	}

	s.mu.Lock()
	s.bs.started()
	if a, err := s.startLocked(); err != nil {
		if err = s.retryLocked(a, err); err != nil {
			s.finishUnlock(err, true)
			return nil, err
		}
	}
	// Under the lock, so that a context already done cannot finish the
	// stream before unwatch is set.
	s.unwatch = context.AfterFunc(s.ctx, s.contextDone)
	s.mu.Unlock()
	return s, nil
}

// SendMsg sends m on the current attempt and, until the stream commits,
// keeps an encoded copy of it for replay. Interceptors after herdguard's see
// m itself, and on a replay a message of m's type with the same content.
func (s *clientStream) SendMsg(m any) error {
	if h := s.hedged; h != nil {
		if err, sent := h.sendMsg(m); sent {
			return err
		}
	}
	var (
		err, end, ret error
		headers       bool
	)
	a, settled, rerr := s.withRetry(
		nil,
		func(a *streamAttempt) {
			err, end, headers = a.cs.SendMsg(m), nil, false
			if err == io.EOF {
				end, headers = a.learnEnd()
			}
		},
		func(a *streamAttempt) (step, error) {
			switch {
			case a != s.a:
				return stepAgain, nil // another goroutine moved the stream on: send there
			case err == nil:
				s.sent++
				if !s.bufferLocked(m) {
					s.commitLocked(true)
				}
				return stepDone, nil
			case err != io.EOF:
				// The client's own error (encoding, size, SendMsg after
				// CloseSend): gRPC ends the stream with it, and so do we.
				// It says nothing of the server.
				a.clientErr = true
				ret = err
				return stepEnd, err
			case !s.state.isOpen() || headers || end == io.EOF:
				// The server answered this attempt, or the stream committed
				// or ended meanwhile: the stream stays with it, and RecvMsg
				// tells how it ended.
				s.answered = s.answered || headers || end == io.EOF
				s.commitLocked(false)
				ret = io.EOF
				return stepDone, nil
			}
			return stepRetry, end
		},
	)
	switch {
	case rerr != nil:
		return io.EOF // RecvMsg reports the stream's status
	case settled:
		return s.sendCommitted(a, m)
	}
	return ret
}

// RecvMsg receives from the current attempt, retrying the stream on a
// retryable failure before it commits. The first message commits it.
func (s *clientStream) RecvMsg(m any) error {
	if h := s.hedged; h != nil {
		<-h.decided // a hedged stream is read once it has committed or ended
	}
	var (
		err, ret    error
		final, done bool // the stream ended with ret; the attempt's result is err, for recvDone
	)
	a, settled, rerr := s.withRetry(
		func(a *streamAttempt) {
			if s.state == streamEnded || s.state == streamDone && a.cs == nil {
				final, ret = true, s.finalLocked()
			}
		},
		func(a *streamAttempt) { err = a.recvFor(s.ctx, m) },
		func(a *streamAttempt) (step, error) {
			switch {
			case a == s.a && s.state.isOpen() && err == nil && !a.keep():
				// The message came as the attempt's timeout fired: the
				// timeout was first, and the message is not taken.
				return stepRetry, errExpired()
			case err == nil:
				s.received++
				if a == s.a {
					s.answeredLocked()
				}
				if !s.desc.ServerStreams {
					return stepEnd, nil // gRPC read the one response to the end
				}
				return stepDone, nil
			case a != s.a || s.state.isEnded():
				return stepAgain, nil // another goroutine moved the stream on
			case s.state.isCommitted() || err == io.EOF:
				// It ended OK, or it committed meanwhile (Context, Trailer):
				// no retry.
				done = true
				return stepDone, nil
			}
			return stepRetry, err
		},
	)
	switch {
	case rerr != nil:
		return rerr
	case settled && final:
		s.ended.Wait() // another goroutine may still be recording the end
		return ret
	case settled:
		return s.recvCommitted(a, m)
	case done:
		return s.recvDone(a, err)
	}
	return nil
}

// Header returns the response headers. Like gRPC's, it drives a retry when
// the current attempt ended without headers; it returns nil and no error
// for a stream that ended without any, and RecvMsg reports how it ended.
// Headers commit the stream.
func (s *clientStream) Header() (metadata.MD, error) {
	if h := s.hedged; h != nil {
		<-h.decided
	}
	var (
		md       metadata.MD
		err, end error
	)
	a, settled, rerr := s.withRetry(
		nil,
		func(a *streamAttempt) {
			md, err = a.cs.Header()
			end = nil
			if md == nil {
				end = err
				if end == nil {
					end, _ = a.learnEnd()
				}
			}
		},
		func(a *streamAttempt) (step, error) {
			switch {
			case a != s.a || s.state.isEnded():
				return stepAgain, nil
			case md != nil && s.state.isOpen() && !a.keep():
				return stepRetry, errExpired() // the timeout was first
			case md != nil:
				s.answeredLocked()
				return stepDone, nil
			case s.state.isCommitted() || end == io.EOF:
				// A trailers-only OK, or the stream committed meanwhile: it
				// is over, and RecvMsg tells how.
				if end == io.EOF {
					s.answeredLocked()
					end = nil
				}
				s.gaveUpBelowLocked(a, end)
				md = nil
				return stepEnd, end
			}
			return stepRetry, end
		},
	)
	switch {
	case rerr != nil:
		return nil, nil // RecvMsg reports the error
	case settled:
		if a.cs == nil {
			return nil, nil
		}
		md, err := a.cs.Header()
		if md != nil {
			s.mu.Lock()
			s.answeredLocked()
			s.mu.Unlock()
		}
		return md, err
	}
	return md, nil
}

// step is what a stream operation's judge tells withRetry.
type step int

const (
	stepDone  step = iota // the operation is over, its result set
	stepAgain             // the stream moved on meanwhile: run it again on the current attempt
	stepRetry             // the attempt ended with the error given: retry the stream
	stepEnd               // the operation ended the stream, with the error given (nil: OK)
)

// withRetry is the one loop every stream operation (SendMsg, RecvMsg,
// Header) runs until the stream commits, as grpc-go's clientStream runs
// its operations, and the one place that takes and releases the stream's
// lock for them. Each turn, if the stream has committed or ended, it calls
// settled (if set) under the lock, and returns the current attempt with
// settled true: the caller goes on with it outside the lock. Otherwise run
// runs the operation on the current attempt outside the lock, and judge,
// under it again, says whether the operation is done, must run again,
// ended the attempt (retryLocked, the one function that decides, waits,
// opens and replays the next attempt, takes it from there), or ended the
// stream. withRetry returns the stream's final error when a retry ended
// it; nil otherwise. It returns with the lock released.
func (s *clientStream) withRetry(settled func(a *streamAttempt), run func(a *streamAttempt), judge func(a *streamAttempt) (step, error)) (*streamAttempt, bool, error) {
	s.mu.Lock()
	for {
		a := s.a
		if !s.state.isOpen() {
			if settled != nil {
				settled(a)
			}
			s.mu.Unlock()
			return a, true, nil
		}
		s.mu.Unlock()
		run(a)
		s.mu.Lock()
		st, err := judge(a)
		switch st {
		case stepDone:
			s.mu.Unlock()
			return a, false, nil
		case stepAgain:
			continue
		case stepEnd:
			s.finishUnlock(err, true)
			return a, false, nil
		}
		if rerr := s.retryLocked(a, err); rerr != nil {
			s.finishUnlock(rerr, true)
			return a, false, rerr
		}
	}
}

// Trailer returns the current attempt's trailer. It commits the stream, as
// gRPC's does: it is meant for after RecvMsg has reported the end.
func (s *clientStream) Trailer() metadata.MD {
	if h := s.hedged; h != nil {
		h.commitNow()
	}
	if a := s.commitNow(); a.cs != nil {
		return a.cs.Trailer()
	}
	return nil
}

// CloseSend closes the sending side of the current attempt and of every
// attempt after it. Like gRPC's, it always returns nil.
func (s *clientStream) CloseSend() error {
	if h := s.hedged; h != nil && h.closeSend() {
		return nil
	}
	s.mu.Lock()
	if s.closeSent {
		s.mu.Unlock()
		return nil
	}
	s.closeSent = true
	defer s.mu.Unlock()
	if a := s.a; a.cs != nil {
		_ = a.cs.CloseSend()
	}
	return nil
}

// Context returns the current attempt's context. As in gRPC, calling it
// commits the stream: the context the caller holds must stay the stream's.
func (s *clientStream) Context() context.Context {
	if h := s.hedged; h != nil {
		h.commitNow()
	}
	if a := s.commitNow(); a.cs != nil {
		return a.cs.Context()
	}
	return s.ctx
}
