package interceptor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/internal/names"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/overload"
)

// defaultStreamBuffer is how many bytes of sent messages a stream keeps for
// replay until it commits: 256 KiB, as gRPC's own retry keeps.
const defaultStreamBuffer = 256 << 10

// frameHeader is the length prefix gRPC puts before every message; the
// replay buffer counts it, as gRPC's own does.
const frameHeader = 5

// errAttemptTimeout is the cause with which a stream attempt's context is
// cancelled when its PerAttemptTimeout passes before the stream commits.
var errAttemptTimeout = errors.New("herdguard: per-attempt timeout")

// Stream returns the stream client interceptor. Every stream kind is
// retried as gRFC A6 describes: opening the stream, and any failure with a
// retryable code before the stream commits, starts a new attempt that
// replays, in order, the messages sent so far and CloseSend. A stream
// commits when the server's response headers or a message reach it, when
// the caller calls Context, or when its replay buffer overflows; after that
// an error reaches the caller as it is. The caller never sees a message
// twice.
func (ic *Interceptor) Stream() grpc.StreamClientInterceptor { return ic.stream }

// retryStream is one logical stream: a series of attempts, each a stream
// from the next streamer, of which the last is current.
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
type retryStream struct {
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
	// ctl is the target's overload controller (nil: off); back puts the
	// next attempt at the back of its line (see inLine).
	ctl     *overload.Controller
	back    bool
	skipped decision // the backoff wait a retry in line skipped
	// breaker is the stream's breaker (nil without one).
	breaker *breaker.Breaker
	// cancelTimeout releases the context of the policy's Timeout, if any.
	cancelTimeout context.CancelFunc

	maxAttempts int
	// hedged is the hedged stream this one is the base of; nil for a
	// stream that is retried. Its methods that the end of a stream calls
	// do nothing when it is nil.
	hedged *hedgedStream

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
	waitTimer    timer // bs.timer: the backoff's timer, made on the first wait
	committed    bool
	answered     bool // the server answered the current attempt (headers, a message, or an OK end)
	overflow     bool
	closeSent    bool
	finished     bool
	err          error // the final error once finished; nil: ended OK
	outcome      Outcome
	idleDeadline bool // the deadline ran out while no attempt was in flight
	gaveUpBelow  bool // it stopped on a "do not retry" from a layer below that gave up (the herdguard-gave-up trailer)
	// breakerDone hears the stream's verdict, once: when the server first
	// answers, or when the stream ends. nil without a breaker or once told.
	breakerDone  func(herdguard.Verdict)
	breakerState breaker.State // as last seen, to record changes as span events
	unwatch      func() bool   // stops watching the caller's context
	// ended is done once the stream's end is recorded (the call span
	// ended, the call counted). A goroutine that finds the stream ended by
	// another, as when the caller's context ends and the watcher ends it,
	// waits for it before it reports the end to the caller, as gRPC's own
	// stream records its end before RecvMsg returns it.
	ended sync.WaitGroup

	// The replay buffer: every message sent before commit, encoded back to
	// back in buf (ends[i] is where message i ends), all of type msgType,
	// plus frameHeader bytes each in bufBytes.
	buf      []byte
	ends     []int
	bufBytes int
	msgType  protoreflect.MessageType
	// The buffer starts in these, so that a stream that sends one small
	// request, as every server stream does, keeps it without allocating.
	bufInline  [64]byte
	endsInline [2]int

	sent, received, replayed, replayedSz int64
}

// streamAttempt is one attempt of a stream.
type streamAttempt struct {
	n       int
	cs      grpc.ClientStream // nil when the attempt failed to open
	live    bool              // the call's context was alive when it started
	started time.Time
	// asked and sent are when the attempt asked the overload controller and
	// when it went, while the controller paced (zero: sent while calm).
	asked, sent time.Time
	cancel      context.CancelCauseFunc
	openCtx     context.Context // a hedge's context until hedgedStream.openHedge opens it
	timeout     *time.Timer     // cancels the attempt at PerAttemptTimeout until commit
	// fate settles, once, the race between the per-attempt timeout and
	// the stream's commit: whichever comes first wins (attemptOpen,
	// attemptKept, attemptExpired).
	fate  atomic.Int32
	span  trace.Span
	ended bool // its span is ended and it is counted; guarded by the stream's mu
	// notSent is why the overload controller did not let the attempt go
	// (shed, or the context ended while it waited); it never opened.
	notSent error
	// clientErr is true when the attempt ended with the client's own error,
	// not the server's: a SendMsg that gRPC or a later interceptor refused.
	// Guarded by the stream's mu.
	clientErr bool

	// recvMu serialises RecvMsg on cs until the stream commits, so that a
	// SendMsg or Header that found the attempt over can learn how it ended
	// without receiving beside the caller.
	recvMu   sync.Mutex
	end      error // how RecvMsg reported the attempt ended (io.EOF: OK)
	endKnown bool
}

var _ grpc.ClientStream = (*retryStream)(nil)

func (ic *Interceptor) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	p, noRetry, err := ic.policyFor(method, opts)
	limit, lerr := streamBufferFor(ic.streamBuffer, opts)
	if err == nil {
		err = lerr
	}
	opts, finish := splitOnFinish(opts)
	target := targetOf(cc)
	s := &retryStream{ic: ic, p: p, tracer: ic.tracing.tracer(), desc: desc, cc: cc, method: method,
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
		ic.metering.call(ctx, method, s.outcome)
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
			ic.metering.call(ctx, method, s.outcome)
			finished(finish, err)
			return nil, err
		}
		s.breakerDone, s.probe = done, probe
		if probe {
			s.maxAttempts = 1
		}
		s.breakerChangedLocked() // admission may have moved an open breaker to half-open
	}
	s.bs.method, s.bs.lim, s.bs.timer = method, ic.limitsFor(target), &s.waitTimer
	s.ctl = ic.controllerFor(target)
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

// contextDone ends the stream when the caller's context ends first. The
// current attempt's context is a child of the caller's and ends by itself,
// with the caller's error: cancelling it here could race the deadline and
// turn DeadlineExceeded into Canceled.
func (s *retryStream) contextDone() {
	s.mu.Lock()
	if a := s.a; a != nil && a.cs != nil && !s.answered && !s.finished {
		// Did the server answer with headers, unseen so far? With the
		// context over, Header returns at once.
		s.mu.Unlock()
		md, _ := a.cs.Header()
		s.mu.Lock()
		if md != nil && s.a == a {
			s.answered = true
		}
	}
	s.finishUnlock(status.FromContextError(s.ctx.Err()).Err(), false)
}

// startLocked opens a new attempt and replays the buffer into it. It
// returns the attempt, which is current from then on, and nil once it runs,
// or the error with which it ended already: it could not open, or it broke
// during the replay.
func (s *retryStream) startLocked() (*streamAttempt, error) {
	back := s.back
	s.back = false
	if back && !s.ctl.Pacing() {
		// The overload passed since: the retry waits as the policy says,
		// never not at all.
		back = false
		if err := s.ic.pause(s.ctx, s.tracer, &s.bs, s.attempts+1, s.skipped); err != nil {
			s.idleDeadline = true
			return &streamAttempt{n: s.attempts + 1, notSent: err}, err
		}
	}
	var asked, sent time.Time
	if s.ctl != nil && s.ctl.Pacing() { // admit's own test, without the clock while calm
		asked = s.ic.clock.Now()
		if err := s.ic.admit(s.ctx, s.tracer, s.ctl, s.method, s.attempts+1, back); err != nil {
			return &streamAttempt{n: s.attempts + 1, notSent: err}, err
		}
		sent = s.ic.clock.Now()
	}
	s.attempts++
	a := &streamAttempt{n: s.attempts, live: s.ctx.Err() == nil, asked: asked, sent: sent}
	if s.ctl != nil && a.live && sent.IsZero() {
		s.ctl.Sent() // sent while calm: refusals are judged against it
	}
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
		a.timeout = time.AfterFunc(d, func() {
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
	for i := range s.ends {
		msg, size, err := s.decodeLocked(i)
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

// decodeLocked decodes the buffer's message i into a new message of the
// caller's type, and returns it with its encoded size.
func (s *retryStream) decodeLocked(i int) (proto.Message, int, error) {
	start := 0
	if i > 0 {
		start = s.ends[i-1]
	}
	msg := s.msgType.New().Interface()
	if err := proto.Unmarshal(s.buf[start:s.ends[i]], msg); err != nil {
		return nil, 0, status.Errorf(codes.Internal, "herdguard: replaying a buffered message: %v", err)
	}
	return msg, s.ends[i] - start, nil
}

// watchHeaders records the server's answer when attempt a's response
// headers arrive, read or not: the stream commits, so that its per-attempt
// timeout stops there (gRFC A6: a server that sent headers has the call),
// and the breaker counts it a success, so that a half-open probe whose
// caller has not read them yet (a watch that waits for its first message,
// an upload that reads at its end) closes the breaker then. It ends when
// the attempt does.
func (s *retryStream) watchHeaders(a *streamAttempt) {
	if md, _ := a.cs.Header(); md == nil {
		return
	}
	s.mu.Lock()
	if s.a == a && !s.finished && a.keep() {
		s.answeredLocked()
	}
	s.mu.Unlock()
}

// retryLocked is called when a, the current attempt, ended with err before
// the stream committed. It decides whether the stream goes on; if so, it
// waits and opens the next attempt (again and again while new attempts end
// at once) and returns nil once one runs. It returns the stream's final
// error otherwise.
func (s *retryStream) retryLocked(a *streamAttempt, err error) error {
	var last error // the last attempt's error
	for {
		if s.finished {
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
			s.outcome, s.gaveUpBelow = d.outcome, d.gaveUpBelow
			return d.err
		}
		s.back, s.skipped = inLine(s.ctl, d, end.err), d // the controller's line replaces the backoff wait
		if !s.back {
			if perr := s.ic.pause(s.ctx, s.tracer, &s.bs, a.n+1, d); perr != nil {
				s.outcome = contextOutcome(s.ctx.Err())
				s.idleDeadline = true
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

// recv receives on the attempt before the stream commits, remembering how
// the attempt ended so that it is learned once.
func (a *streamAttempt) recv(m any) error {
	a.recvMu.Lock()
	defer a.recvMu.Unlock()
	if a.endKnown {
		return a.end
	}
	err := a.cs.RecvMsg(m)
	if err != nil {
		a.end, a.endKnown = err, true
	}
	return err
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

// commitLocked makes the current attempt final: no more retries, no more
// buffering, no per-attempt timeout.
func (s *retryStream) commitLocked(overflow bool) {
	if s.committed {
		return
	}
	s.committed, s.overflow = true, overflow
	s.buf, s.ends, s.bufBytes = nil, nil, 0
	if t := s.a.timeout; t != nil {
		t.Stop()
		// If the timeout fired first, the attempt is cancelled: the
		// stream commits to it all the same (Context, an overflow, the
		// headers of an attempt already ended), and fails with
		// DeadlineExceeded (recvCommitted).
		s.a.fate.CompareAndSwap(attemptOpen, attemptKept)
	}
}

// answeredLocked records that the server's answer (response headers or a
// message, or the end of a stream that ended OK) reached the caller: the
// stream commits, and the breaker counts it a success now, not when the
// stream ends, so that a long healthy stream admitted as a half-open probe
// closes the breaker at once. A failure after this counts for nothing more.
func (s *retryStream) answeredLocked() {
	s.answered = true
	s.commitLocked(false)
	if s.breakerDone != nil {
		s.breakerDone(herdguard.Success)
		s.breakerDone = nil
		s.breakerChangedLocked()
	}
}

// bufferLocked keeps a copy of m, just sent, for replay; a message that
// cannot be kept, or that outgrows the buffer, commits the stream.
func (s *retryStream) bufferLocked(m any) {
	if s.committed || s.finished {
		return
	}
	pm, ok := m.(proto.Message)
	if !ok {
		s.commitLocked(true) // only protobuf messages can be encoded here
		return
	}
	t := pm.ProtoReflect().Type()
	if s.msgType == nil {
		s.msgType = t
	} else if t != s.msgType {
		s.commitLocked(true)
		return
	}
	if s.ends == nil {
		s.buf, s.ends = s.bufInline[:0], s.endsInline[:0]
	}
	start := len(s.buf)
	buf, err := proto.MarshalOptions{}.MarshalAppend(s.buf, pm)
	if err != nil || s.bufBytes+len(buf)-start+frameHeader > s.limit {
		s.buf = buf[:start]
		s.commitLocked(true)
		return
	}
	s.buf = buf
	s.ends = append(s.ends, len(buf))
	s.bufBytes += len(buf) - start + frameHeader
}

// SendMsg sends m on the current attempt and, until the stream commits,
// keeps an encoded copy of it for replay. Interceptors after herdguard's see
// m itself, and on a replay a message of m's type with the same content.
func (s *retryStream) SendMsg(m any) error {
	s.mu.Lock()
	var (
		err, end, ret error
		headers       bool
	)
	if rerr := s.withRetry(
		func(a *streamAttempt) bool {
			if !s.committed && !s.finished {
				return false
			}
			s.mu.Unlock()
			ret = s.sendCommitted(a, m)
			return true
		},
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
				s.bufferLocked(m)
				s.mu.Unlock()
				return stepDone, nil
			case err != io.EOF:
				// The client's own error (encoding, size, SendMsg after
				// CloseSend): gRPC ends the stream with it, and so do we.
				// It says nothing of the server.
				a.clientErr = true
				s.finishUnlock(err, true)
				ret = err
				return stepDone, nil
			case s.committed || s.finished || headers || end == io.EOF:
				// The server answered this attempt, or the stream committed
				// or ended meanwhile: the stream stays with it, and RecvMsg
				// tells how it ended.
				s.answered = s.answered || headers || end == io.EOF
				s.commitLocked(false)
				s.mu.Unlock()
				ret = io.EOF
				return stepDone, nil
			}
			return stepRetry, end
		},
	); rerr != nil {
		return io.EOF // RecvMsg reports the stream's status
	}
	return ret
}

// sendCommitted sends on a committed or finished stream.
func (s *retryStream) sendCommitted(a *streamAttempt, m any) error {
	if a.cs == nil {
		// The stream ended without an attempt that opened: answer as
		// gRPC's own stream answers once it is over.
		s.mu.Lock()
		after := s.closeSent || !s.desc.ClientStreams && s.sent > 0
		s.mu.Unlock()
		switch {
		case after:
			return status.Error(codes.Internal, "SendMsg called after CloseSend")
		case s.desc.ClientStreams:
			return io.EOF
		}
		return nil
	}
	err := a.cs.SendMsg(m)
	s.mu.Lock()
	switch {
	case err == nil:
		s.sent++
		s.mu.Unlock()
	case err != io.EOF:
		a.clientErr = true
		s.finishUnlock(err, true)
	default:
		s.mu.Unlock()
	}
	return err
}

// RecvMsg receives from the current attempt, retrying the stream on a
// retryable failure before it commits. The first message commits it.
func (s *retryStream) RecvMsg(m any) error {
	s.mu.Lock()
	var err, ret error
	if rerr := s.withRetry(
		func(a *streamAttempt) bool {
			switch {
			case s.finished && (!s.committed || a.cs == nil):
				ret = s.finalLocked()
				s.mu.Unlock()
				s.ended.Wait()
			case s.committed:
				s.mu.Unlock()
				ret = s.recvCommitted(a, m)
			default:
				return false
			}
			return true
		},
		func(a *streamAttempt) { err = a.recv(m) },
		func(a *streamAttempt) (step, error) {
			switch {
			case a == s.a && !s.committed && !s.finished && err == nil && !a.keep():
				// The message came as the attempt's timeout fired: the
				// timeout was first, and the message is not taken.
				return stepRetry, errExpired()
			case err == nil:
				s.received++
				if a == s.a {
					s.answeredLocked()
				}
				if !s.desc.ServerStreams {
					s.finishUnlock(nil, true) // gRPC read the one response to the end
				} else {
					s.mu.Unlock()
				}
				ret = nil
				return stepDone, nil
			case a != s.a || s.finished:
				return stepAgain, nil // another goroutine moved the stream on
			case s.committed || err == io.EOF:
				// It ended OK, or it committed meanwhile (Context, Trailer):
				// no retry.
				s.mu.Unlock()
				ret = s.recvDone(err)
				return stepDone, nil
			}
			return stepRetry, err
		},
	); rerr != nil {
		return rerr
	}
	return ret
}

// recvCommitted receives on a committed stream. It receives through the
// attempt's recv, as before commit: a SendMsg that began before the commit
// may still be learning how the attempt ended, and two receives at once on
// one gRPC stream would lose its end.
func (s *retryStream) recvCommitted(a *streamAttempt, m any) error {
	err := a.recv(m)
	if err != nil && err != io.EOF && a.expired() && s.ctx.Err() == nil {
		err = errExpired() // gRPC says Canceled: the attempt's timeout cancelled it
	}
	return s.recvDone(err)
}

// recvDone records what a RecvMsg that is not retried returned, and ends
// the stream once it is over.
func (s *retryStream) recvDone(err error) error {
	s.mu.Lock()
	if err == nil {
		s.received++
	}
	if err == nil || err == io.EOF {
		s.answeredLocked() // the breaker may not have heard yet (Context, overflow)
	}
	switch {
	case err == nil && s.desc.ServerStreams:
		s.mu.Unlock()
	case err == nil, err == io.EOF:
		s.finishUnlock(nil, true) // gRPC read the one response to the end, or the stream ended OK
	default:
		s.finishUnlock(err, true)
	}
	return err
}

// finalLocked is what RecvMsg returns once the stream ended.
func (s *retryStream) finalLocked() error {
	if s.err == nil {
		return io.EOF
	}
	return s.err
}

// Header returns the response headers. Like gRPC's, it drives a retry when
// the current attempt ended without headers; it returns nil and no error
// for a stream that ended without any, and RecvMsg reports how it ended.
// Headers commit the stream.
func (s *retryStream) Header() (metadata.MD, error) {
	s.mu.Lock()
	var (
		md, retMD metadata.MD
		err, end  error
		retErr    error
	)
	if rerr := s.withRetry(
		func(a *streamAttempt) bool {
			if !s.committed && !s.finished {
				return false
			}
			s.mu.Unlock()
			if a.cs == nil {
				return true
			}
			retMD, retErr = a.cs.Header()
			if retMD != nil {
				s.mu.Lock()
				s.answeredLocked()
				s.mu.Unlock()
			}
			return true
		},
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
			case a != s.a || s.finished:
				return stepAgain, nil
			case md != nil && !s.committed && !a.keep():
				return stepRetry, errExpired() // the timeout was first
			case md != nil:
				s.answeredLocked()
				s.mu.Unlock()
				retMD = md
				return stepDone, nil
			case s.committed || end == io.EOF:
				// A trailers-only OK, or the stream committed meanwhile: it
				// is over, and RecvMsg tells how.
				if end == io.EOF {
					s.answeredLocked()
					end = nil
				}
				s.finishUnlock(end, true)
				return stepDone, nil
			}
			return stepRetry, end
		},
	); rerr != nil {
		return nil, nil // RecvMsg reports the error
	}
	return retMD, retErr
}

// step is what a stream operation's judge tells withRetry.
type step int

const (
	stepDone  step = iota // the operation is over: its result is set, the lock released
	stepAgain             // the stream moved on meanwhile: run it again on the current attempt
	stepRetry             // the attempt ended with the error given: retry the stream
)

// withRetry is the one loop every stream operation (SendMsg, RecvMsg,
// Header) runs until the stream commits, as grpc-go's clientStream runs
// its operations: the caller holds the lock. Each turn, committed (under
// the lock) handles a stream that has committed or ended, and reports true
// once it has, with the lock released; otherwise run runs the operation on
// the current attempt outside the lock, and judge, under it again, says
// whether it is done, must run again, or ended the attempt. An ended
// attempt goes to retryLocked, the one function that decides, waits,
// opens and replays the next. withRetry returns the stream's final error,
// having finished the stream, when the retry ended it; nil otherwise. It
// returns with the lock released.
func (s *retryStream) withRetry(committed func(a *streamAttempt) bool, run func(a *streamAttempt), judge func(a *streamAttempt) (step, error)) error {
	for {
		a := s.a
		if committed(a) {
			return nil
		}
		s.mu.Unlock()
		run(a)
		s.mu.Lock()
		st, end := judge(a)
		switch st {
		case stepDone:
			return nil
		case stepAgain:
			continue
		}
		if rerr := s.retryLocked(a, end); rerr != nil {
			s.finishUnlock(rerr, true)
			return rerr
		}
	}
}

// Trailer returns the current attempt's trailer. It commits the stream, as
// gRPC's does: it is meant for after RecvMsg has reported the end.
func (s *retryStream) Trailer() metadata.MD {
	if a := s.commitNow(); a.cs != nil {
		return a.cs.Trailer()
	}
	return nil
}

// CloseSend closes the sending side of the current attempt and of every
// attempt after it. Like gRPC's, it always returns nil.
func (s *retryStream) CloseSend() error {
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
func (s *retryStream) Context() context.Context {
	if a := s.commitNow(); a.cs != nil {
		return a.cs.Context()
	}
	return s.ctx
}

// commitNow commits a stream that is not over yet to its current attempt,
// and returns that attempt.
func (s *retryStream) commitNow() *streamAttempt {
	s.mu.Lock()
	if !s.finished {
		s.commitLocked(false)
	}
	defer s.mu.Unlock()
	return s.a
}

// finishUnlock records the stream's final status once: for the breaker, on
// the span, and by releasing the buffer and the current attempt. The caller
// holds the lock, which it releases. The stream is marked ended before the
// lock is released, so that no other goroutine can find it given up but
// not ended, with a current attempt that never opened. release is false
// when the caller's context ended, which ends the current attempt by itself.
func (s *retryStream) finishUnlock(err error, release bool) {
	if s.finished {
		s.mu.Unlock()
		s.ended.Wait() // another goroutine is recording the end
		return
	}
	s.finished, s.err = true, err
	a := s.a
	if a == nil {
		// No attempt was sent: the overload controller shed the first, or
		// the context ended while it waited.
		a = &streamAttempt{ended: true, cancel: func(error) {}}
	}
	s.hedged.endHedgingLocked(a)
	s.buf, s.ends, s.bufBytes = nil, nil, 0
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
	s.endAttemptLocked(a, err)
	if s.breakerDone != nil {
		v := herdguard.Ignored
		if !a.clientErr && s.outcome != OutcomeShed && !s.gaveUpBelow && !s.idleAtDeadlineLocked(err) {
			v = s.ic.verdict(s.ctx, err, s.idleDeadline || !a.live)
		}
		s.breakerDone(v)
		s.breakerDone = nil
		s.breakerChangedLocked()
	}
	unwatch := s.unwatch
	s.mu.Unlock()

	if unwatch != nil {
		unwatch()
	}
	s.hedged.fillCatchers(a)
	if release {
		a.release()
	} else if a.timeout != nil {
		a.timeout.Stop()
	}
	if s.cancelTimeout != nil {
		s.cancelTimeout()
	}
	if err == nil {
		s.bs.succeeded()
	}
	s.endSpan(err)
	s.ic.metering.call(s.ctx, s.method, s.outcome)
	finished(s.onFinish, err)
	s.ended.Done()
}

// idleAtDeadlineLocked reports whether the stream, ending with err, was
// ended by its caller's deadline before the server answered and before the
// caller half-closed it (a server stream whose request went is half-closed:
// that is all it sends). The server then had no reason to answer yet: it
// may wait for more, and a watch or long poll that idles until its
// deadline is normal. Such an end tells neither the breaker nor the
// overload controller anything; through gRPC alone it ends
// DeadlineExceeded, and so it does here, however many there are. Counted
// as hung, 20 idle bidi streams under one 20ms deadline opened the
// breaker, and 480 of the next 480 were refused. A stream the caller
// half-closed, a server stream whose server never answers, and a unary
// call still count as hung.
//
// The caller's deadline is read off the clock, not the context: the
// server's copy of it, or gRPC's, may end the stream a moment before the
// context's own timer has run.
func (s *retryStream) idleAtDeadlineLocked(err error) bool {
	if s.answered || s.closeSent || !s.desc.ClientStreams && s.sent > 0 || status.Code(err) != codes.DeadlineExceeded {
		return false
	}
	dl, ok := s.ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// breakerChangedLocked records a change of the breaker's state since it was
// last seen as an event on the call span.
func (s *retryStream) breakerChangedLocked() {
	if s.span == nil || s.breaker == nil {
		return
	}
	if now := s.breaker.LastState(); now != s.breakerState {
		breakerChanged(s.span, s.breaker.Scope(), s.breakerState, now)
		s.breakerState = now
	}
}

// notSentLocked ends a stream whose attempt a the overload controller did
// not let go; last is the previous attempt's error, if any.
func (s *retryStream) notSentLocked(a *streamAttempt, last error) error {
	if errors.Is(a.notSent, overload.ErrShed) {
		s.outcome = OutcomeShed
		return shedError(a.n, last, a.notSent)
	}
	s.outcome = contextOutcome(s.ctx.Err())
	s.idleDeadline = true
	return a.notSent
}

// endAttemptLocked ends an attempt's span and counts it, once, and tells
// the overload controller how it ended.
func (s *retryStream) endAttemptLocked(a *streamAttempt, err error) {
	if a.ended {
		return
	}
	a.ended = true
	switch {
	case !a.live:
		// Its context was over before it went out: it was never sent,
		// and says nothing of the server's load.
	case a == s.a && s.answered && status.Code(err) == codes.DeadlineExceeded:
		// The server answered this attempt in time, and the caller's
		// deadline ended the stream it was serving: that says nothing of
		// its load, and a watch stream lives until its deadline.
		attemptDone(s.ctl, nil)
	case a == s.a && s.idleAtDeadlineLocked(err):
		// Nobody asked the server for an answer yet: it says nothing.
		if s.ctl != nil {
			s.ctl.Done(overload.Ignored)
		}
	case timedOutIn(s.ctx, s.ctl, err, a.expired(), a.asked, a.sent):
		// Unanswered when the caller's deadline passed: told as the
		// time it waited in the line against the time it had left.
	default:
		attemptDone(s.ctl, err)
	}
	hedge, won := s.hedged.roleOf(a.n)
	s.ic.attemptEnded(s.ctx, s.method, a.span, a.n, err, hedge, won)
}

func (s *retryStream) endSpan(err error) {
	if s.span == nil {
		return
	}
	s.mu.Lock()
	s.span.SetAttributes(
		names.AttrStreamSent.Int64(s.sent),
		names.AttrStreamReceived.Int64(s.received),
		names.AttrStreamReplayedMessages.Int64(s.replayed),
		names.AttrStreamReplayedBytes.Int64(s.replayedSz),
		names.AttrStreamOverflow.Bool(s.overflow),
	)
	if s.probe {
		s.span.SetAttributes(names.AttrBreakerProbe.Bool(true))
	}
	s.hedged.spanAttributes(s.span, s.attempts)
	attempts, outcome := s.attempts, s.outcome
	s.mu.Unlock()
	st := status.Convert(err)
	endCall(s.span, attempts, outcome, st.Code(), st.Message())
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
