package interceptor

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/herdguard/herdguard/internal/errs"
)

// errAttemptTimeout is the cause with which a stream attempt's context is
// cancelled when its PerAttemptTimeout passes before the stream commits.
var errAttemptTimeout = errs.New("per-attempt timeout")

// streamAttempt is one attempt of a stream.
type streamAttempt struct {
	n       int
	cs      grpc.ClientStream // nil when the attempt failed to open
	started time.Time
	ticket  ticket // its place with the overload controller
	cancel  context.CancelCauseFunc
	openCtx context.Context // a hedge's context until streamHedging.openHedge opens it
	timeout clock.Timer     // cancels the attempt at PerAttemptTimeout until commit
	// fate settles, once, the race between the per-attempt timeout and
	// the stream's commit: whichever comes first wins (attemptOpen,
	// attemptKept, attemptExpired).
	fate  atomic.Int32
	ended bool // its span is ended and it is counted; guarded by the stream's mu
	// clientErr is true when the attempt ended with the client's own error,
	// not the server's: a SendMsg that gRPC or a later interceptor refused.
	// Guarded by the stream's mu.
	clientErr bool
	// gaveUpBelow is true when its trailer said a layer below gave up
	// (gaveUpBelow). Guarded by the stream's mu.
	gaveUpBelow bool
	span        trace.Span
	// notSent is why the overload controller did not let the attempt go
	// (shed, or the context ended while it waited); it never opened.
	notSent error

	// recvMu serialises RecvMsg on cs until the stream commits, so that a
	// SendMsg or Header that found the attempt over can learn how it ended
	// without receiving beside the caller.
	recvMu sync.Mutex
	end    error // how RecvMsg reported the attempt ended (io.EOF: OK); set before over
	// over is set once a RecvMsg on cs has returned an error (io.EOF
	// included): end is known, gRPC's stream is over, and its trailer is
	// safe to read, without recvMu, which a RecvMsg may hold.
	over atomic.Bool
}

// startLocked opens a new attempt and replays the buffer into it. It
// returns the attempt, which is current from then on, and nil once it runs,
// or the error with which it ended already: it could not open, or it broke
// during the replay.
func (s *clientStream) startLocked() (*streamAttempt, error) {
	back := s.back
	s.back = false
	if back && !paces(s.ctl) {
		// The overload passed since: the retry waits as the policy says,
		// never not at all.
		back = false
		if err := s.ic.pause(s.ctx, s.tracer, &s.bs, s.attempts+1, s.skipped); err != nil {
			s.notInFlight = true
			return &streamAttempt{n: s.attempts + 1, notSent: err}, err
		}
	}
	place := pacing.Fresh
	if back {
		place = pacing.Back
	}
	a := &streamAttempt{n: s.attempts + 1}
	if err := s.ic.take(s.ctx, s.tracer, s.ctl, s.method, s.bs.target, a.n, place, &a.ticket); err != nil {
		a.notSent = err
		return a, err
	}
	a.ticket.untimed = true
	s.attempts++
	if s.hedged.timed() { // latency is recorded only for a latency-aware delay
		a.started = s.ic.clock.Now()
	}
	s.a = a
	ctx := s.ctx
	if a.n > 1 {
		ctx = s.numbers.context(ctx, a.n, s.maxAttempts)
	}
	ctx, a.cancel = context.WithCancelCause(ctx)
	if d := s.p.p.PerAttemptTimeout; d > 0 {
		a.timeout = s.ic.clock.AfterFunc(d, func() {
			if a.fate.CompareAndSwap(attemptOpen, attemptExpired) {
				a.cancel(errAttemptTimeout)
			}
		})
	}
	if s.tracer != nil {
		ctx, a.span = startAttempt(ctx, s.tracer, s.method, a.n)
	}
	cs, err := s.streamer(ctx, s.desc, s.cc, s.method, s.opts...)
	if err != nil {
		return a, err
	}
	a.cs = cs
	if a.timeout != nil || s.probe && s.breakerDone != nil {
		// The per-attempt timeout stops at the headers, and a half-open
		// probe's verdict may not wait for the caller to read them.
		go s.watchHeaders(a)
	}
	for i := range s.replay.len() {
		msg, size, err := s.replay.message(i)
		if err == nil {
			err = cs.SendMsg(msg)
		}
		if err != nil {
			if err != io.EOF {
				// The client's own error, or a later interceptor's: the
				// attempt is alive, so end it before it is judged.
				a.clientErr = true
				a.release()
				return a, err
			}
			// The attempt broke during the replay: learn how.
			end, headers := a.learnEnd()
			if headers || end == io.EOF {
				s.answered = true
				s.commitLocked(false) // the server answered this attempt
				return a, nil
			}
			return a, end
		}
		s.replayed++
		s.replayedSz += int64(size)
	}
	if s.closeSent {
		_ = cs.CloseSend() // gRPC's CloseSend always returns nil
	}
	return a, nil
}

// watchHeaders records the server's answer when attempt a's response
// headers arrive, read or not: the stream commits, so that its per-attempt
// timeout stops there (gRFC A6: a server that sent headers has the call),
// and the breaker counts it a success, so that a half-open probe whose
// caller has not read them yet (a watch that waits for its first message,
// an upload that reads at its end) closes the breaker then. It ends when
// the attempt does.
func (s *clientStream) watchHeaders(a *streamAttempt) {
	if md, _ := a.cs.Header(); md == nil {
		return
	}
	s.mu.Lock()
	if s.a == a && !s.state.isEnded() && a.keep() {
		s.answeredLocked()
	}
	s.mu.Unlock()
}

// retryLocked is called when a, the current attempt, ended with err before
// the stream committed. It decides whether the stream goes on; if so, it
// waits and opens the next attempt (again and again while new attempts end
// at once) and returns nil once one runs. It returns the stream's final
// error otherwise.
func (s *clientStream) retryLocked(a *streamAttempt, err error) error {
	var last error // the last attempt's error
	for {
		if s.state.isEnded() {
			return s.err
		}
		if a.notSent != nil {
			return s.notSentLocked(a, last)
		}
		end := attemptEnd{n: a.n, err: err, timedOut: a.expired(), reached: a.cs != nil, client: a.clientErr}
		if end.timedOut {
			end.err = errExpired()
		}
		if a.cs != nil {
			// gRFC A6: a server that sent response headers has the call;
			// only a trailers-only response may be retried.
			md, _ := a.cs.Header()
			end.headers = md != nil
			if !end.headers {
				end.trailer = a.cs.Trailer()
				a.gaveUpBelow = end.err != nil && gaveUpBelow(end.trailer)
			} else {
				// Committed: the failure stands as it is (decide), but a
				// layer below's give-up is counted by neither the breaker
				// nor the overload controller.
				a.gaveUpBelow = a.gaveUpBelowOnceOver(end.err)
			}
		}
		if end.headers {
			s.answered = true
			s.commitLocked(false)
		}
		s.endAttemptLocked(a, end.err)
		a.release()
		last = end.err
		d := s.ic.decide(s.ctx, s.p, &s.bs, s.maxAttempts, end)
		if !d.retry {
			s.outcome, s.gaveUpBelow = d.outcome, d.gaveUpBelow || a.gaveUpBelow
			return d.err
		}
		s.back, s.skipped = inLine(s.ctl, d, end.err), d // the controller's line replaces the backoff wait
		if !s.back {
			if perr := s.ic.pause(s.ctx, s.tracer, &s.bs, a.n+1, d); perr != nil {
				s.outcome = contextOutcome(s.ctx.Err())
				s.notInFlight = true
				return perr
			}
		}
		if a, err = s.startLocked(); err == nil {
			return nil
		}
	}
}

// learnEnd tells how an attempt that is over (its SendMsg returned io.EOF,
// or Header returned no headers) ended: headers is true when the server had
// sent response headers; otherwise end is the attempt's status error, or
// io.EOF for OK. With no headers there can be no message, so receiving into
// a placeholder takes nothing from the caller.
func (a *streamAttempt) learnEnd() (end error, headers bool) {
	if md, _ := a.cs.Header(); md != nil {
		return nil, true
	}
	return a.recv(new(emptypb.Empty)), false
}

// recvFor receives for the caller, whose context is ctx. Once that
// context has ended, the attempt ends with it, as gRPC's stream does once
// it has seen the cancellation, even when an answer came meanwhile: a
// caller that cancelled gets Canceled (or DeadlineExceeded), not an
// answer that raced the cancellation. An attempt whose end is known keeps
// it.
func (a *streamAttempt) recvFor(ctx context.Context, m any) error {
	if err := ctx.Err(); err != nil {
		a.recvMu.Lock()
		defer a.recvMu.Unlock()
		if !a.over.Load() {
			a.end = status.FromContextError(err).Err()
			a.over.Store(true)
		}
		return a.end
	}
	return a.recv(m)
}

// recv receives on the attempt before the stream commits, remembering how
// the attempt ended so that it is learned once.
func (a *streamAttempt) recv(m any) error {
	a.recvMu.Lock()
	defer a.recvMu.Unlock()
	if a.over.Load() {
		return a.end
	}
	err := a.cs.RecvMsg(m)
	if err != nil {
		a.end = err
		a.over.Store(true)
	}
	return err
}

// gaveUpBelowOnceOver reports whether a, which ended with err after the
// stream committed to it, was failed by a layer below's give-up
// (gaveUpBelow): the answer cannot be retried, but it is no evidence
// against this target either. The trailer is read only once a RecvMsg on
// a has reported the end (gRPC's contract for Trailer); before that, or
// for the client's own error, it reports false.
func (a *streamAttempt) gaveUpBelowOnceOver(err error) bool {
	return err != nil && err != io.EOF && a.cs != nil && !a.clientErr && a.over.Load() && gaveUpBelow(a.cs.Trailer())
}

// The fates of a stream attempt under a per-attempt timeout.
const (
	attemptOpen    int32 = iota // neither yet
	attemptKept                 // the stream committed first: the timeout does nothing
	attemptExpired              // the timeout fired first: the attempt is cancelled, and its answer not taken
)

// expired reports whether a's per-attempt timeout fired before the stream
// committed to it.
func (a *streamAttempt) expired() bool { return a.fate.Load() == attemptExpired }

// keep claims a, whose answer just came, against its per-attempt timeout:
// it reports false when the timeout fired first, and the answer is not to
// be taken. Once it reports true, the timeout can no longer cancel a.
func (a *streamAttempt) keep() bool {
	return a.timeout == nil || a.fate.CompareAndSwap(attemptOpen, attemptKept) || a.fate.Load() == attemptKept
}

// errExpired is what an attempt whose per-attempt timeout fired first
// ended with, whatever gRPC returned after its context was cancelled.
func errExpired() error { return status.Error(codes.DeadlineExceeded, errAttemptTimeout.Error()) }

// release stops an attempt's timeout and cancels its context, freeing what
// gRPC holds for it. Its header and trailer stay readable.
func (a *streamAttempt) release() {
	if a.timeout != nil {
		a.timeout.Stop()
	}
	a.cancel(nil)
}

// notSentLocked ends a stream whose attempt a the overload controller did
// not let go; last is the previous attempt's error, if any.
func (s *clientStream) notSentLocked(a *streamAttempt, last error) error {
	if errors.Is(a.notSent, pacing.ErrShed) {
		s.outcome = OutcomeShed
		return shedError(a.n, last, a.notSent)
	}
	s.outcome = contextOutcome(s.ctx.Err())
	s.notInFlight = true
	return a.notSent
}
