package interceptor

import (
	"io"

	"github.com/herdguard/herdguard/internal/names"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
)

// contextDone ends the stream when the caller's context ends first. The
// current attempt's context is a child of the caller's and ends by itself,
// with the caller's error: cancelling it here could race the deadline and
// turn DeadlineExceeded into Canceled.
func (s *clientStream) contextDone() {
	s.mu.Lock()
	if a := s.a; a != nil && a.cs != nil && !s.answered && !s.state.isEnded() {
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

// commitLocked makes the current attempt final: no more retries, no more
// buffering, no per-attempt timeout.
func (s *clientStream) commitLocked(overflow bool) {
	if !s.state.isOpen() {
		return
	}
	s.state, s.overflow = streamCommitted, overflow
	s.replay.release()
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
func (s *clientStream) answeredLocked() {
	s.answered = true
	s.commitLocked(false)
	if s.breakerDone != nil {
		s.breakerDone(herdguard.Success)
		s.breakerDone = nil
		s.breakerChangedLocked()
	}
}

// commitNow commits a stream that is not over yet to its current attempt,
// and returns that attempt.
func (s *clientStream) commitNow() *streamAttempt {
	s.mu.Lock()
	if s.state.isOpen() {
		s.commitLocked(false)
	}
	defer s.mu.Unlock()
	return s.a
}

// sendCommitted sends on a committed or finished stream.
func (s *clientStream) sendCommitted(a *streamAttempt, m any) error {
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

// recvCommitted receives on a committed stream. It receives through the
// attempt's recv, as before commit: a SendMsg that began before the commit
// may still be learning how the attempt ended, and two receives at once on
// one gRPC stream would lose its end.
func (s *clientStream) recvCommitted(a *streamAttempt, m any) error {
	err := a.recvFor(s.ctx, m)
	if err != nil && err != io.EOF && a.expired() && s.ctx.Err() == nil {
		err = errExpired() // gRPC says Canceled: the attempt's timeout cancelled it
	}
	return s.recvDone(a, err)
}

// recvDone records what a RecvMsg on a that is not retried returned, and
// ends the stream once it is over. A committed stream's failure is
// returned as it is, on this RecvMsg and every later one; if a layer below
// gave up (gaveUpBelowOnceOver), neither the breaker nor the overload
// controller counts it.
func (s *clientStream) recvDone(a *streamAttempt, err error) error {
	s.mu.Lock()
	if err == nil {
		s.received++
	}
	s.gaveUpBelowLocked(a, err)
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

// gaveUpBelowLocked leaves the failure err of a, the attempt a committed stream
// ends with, out of the breaker's and the overload controller's counts
// when a layer below gave up (gaveUpBelowOnceOver).
func (s *clientStream) gaveUpBelowLocked(a *streamAttempt, err error) {
	if a == s.a && !s.state.isEnded() && a.gaveUpBelowOnceOver(err) {
		a.gaveUpBelow, s.gaveUpBelow = true, true
	}
}

// finalLocked is what RecvMsg returns once the stream ended.
func (s *clientStream) finalLocked() error {
	if s.err == nil {
		return io.EOF
	}
	return s.err
}

// finishUnlock records the stream's final status once: for the breaker, on
// the span, and by releasing the buffer and the current attempt. The caller
// holds the lock, which it releases. The stream is marked ended before the
// lock is released, so that no other goroutine can find it given up but
// not ended, with a current attempt that never opened. release is false
// when the caller's context ended, which ends the current attempt by itself.
func (s *clientStream) finishUnlock(err error, release bool) {
	if s.state.isEnded() {
		s.mu.Unlock()
		s.ended.Wait() // another goroutine is recording the end
		return
	}
	committed := s.state.isCommitted()
	s.state, s.err = s.state.end(), err
	a := s.a
	if a == nil {
		// No attempt was sent: the overload controller shed the first, or
		// the context ended while it waited.
		a = &streamAttempt{ended: true, cancel: func(error) {}}
	}
	s.hedged.endHedgingLocked(a)
	s.replay.release()
	if s.outcome == "" {
		switch {
		case err == nil:
			s.outcome = OutcomeOK
		case s.ctx.Err() != nil:
			s.outcome = contextOutcome(s.ctx.Err())
		case committed:
			s.outcome = OutcomeFailedAfterCommit
		default:
			s.outcome = OutcomeNotRetryable
		}
	}
	s.endAttemptLocked(a, err)
	if s.breakerDone != nil {
		v := herdguard.Ignored // an idle stream at its deadline says nothing of the server
		if !s.idleAtDeadlineLocked(err) {
			v = s.ic.verdict(s.ctx, s.ctl, &callEnd{err: err, clientErr: a.clientErr, outcome: s.outcome, gaveUpBelow: s.gaveUpBelow, notInFlight: s.notInFlight || !a.ticket.live})
		}
		s.breakerDone(v)
		s.breakerDone = nil
		s.breakerChangedLocked()
	}
	unwatch, attempts := s.unwatch, s.attempts
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
	s.ic.metering.call(s.ctx, s.method, s.bs.target, s.outcome)
	if err != nil && s.ic.events.on {
		s.ic.gaveUp(s.ctx, s.method, s.bs.target, s.outcome, attempts, err)
	}
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
func (s *clientStream) idleAtDeadlineLocked(err error) bool {
	if s.answered || s.closeSent || !s.desc.ClientStreams && s.sent > 0 || status.Code(err) != codes.DeadlineExceeded {
		return false
	}
	dl, ok := s.ctx.Deadline()
	return ok && !s.ic.clock.Now().Before(dl)
}

// breakerChangedLocked records a change of the breaker's state since it was
// last seen as an event on the call span.
func (s *clientStream) breakerChangedLocked() {
	if s.span == nil || s.breaker == nil {
		return
	}
	if now := s.breaker.LastState(); now != s.breakerState {
		breakerChanged(s.span, s.breaker.Scope(), s.breakerState, now)
		s.breakerState = now
	}
}

// endAttemptLocked ends an attempt's span and counts it, once, and tells
// the overload controller how it ended.
func (s *clientStream) endAttemptLocked(a *streamAttempt, err error) {
	if a.ended {
		return
	}
	a.ended = true
	e := attemptEnd{n: a.n, err: err, timedOut: a.expired(), gaveUpBelow: a.gaveUpBelow, span: a.span}
	if err == nil && a.cs != nil && a.over.Load() {
		e.trailer = a.cs.Trailer() // safe to read once a RecvMsg has ended the stream
	}
	if a == s.a {
		e.answered = s.answered
		e.idle = s.idleAtDeadlineLocked(err)
	}
	hedge, won := s.hedged.roleOf(a.n)
	s.ic.finish(s.ctx, s.method, s.bs.target, &a.ticket, &e, hedge, won)
}

func (s *clientStream) endSpan(err error) {
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
