package interceptor

import (
	"context"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// streamHedge is what a hedged stream (gRFC A6 hedging) keeps until it
// commits. Until then every attempt in flight gets every message the caller
// sends, and a new hedge gets the replay buffer first, opened and replayed
// to without the stream's lock (openHedge) so that it holds up no other
// attempt, until it has caught up and joins the others. A goroutine per
// attempt waits for its response headers: the first attempt to answer wins
// the stream, which commits to it and cancels the others; the caller's
// RecvMsg and Header wait for that. An attempt that ends without headers is
// judged as a hedged unary call's attempt is: a non-fatal failure sends the
// next hedge at once, a fatal one ends the stream. Once the replay buffer
// overflows (or the caller calls Context), the stream commits to its oldest
// attempt in flight, which has every message, and no hedge starts; with
// none in flight it waits for a hedge being opened, and with none opening
// either it ends with the last failure.
type streamHedge struct {
	hedgeRules
	decided chan struct{} // closed once the stream commits or ends

	// want are where the caller's Header, Trailer and Peer options point;
	// the stream's attempts run without them, and the stream fills them
	// from its final attempt when it ends.
	want callerCatchers

	// guarded by the stream's mu
	live    []*streamAttempt // attempts open and not ended, oldest first
	opening []*streamAttempt // hedges being opened and replayed to, without the lock
	changed *sync.Cond       // on the stream's mu: an opening hedge went live or ended
	sendTo  []*streamAttempt // SendMsg's copy of live
	timer   timer
	noMore  bool
	stopped bool   // a pushback said not to hedge again
	refused string // the budget that refused a hedge
	last    error  // the last non-fatal failure
	winner  int    // the number of the attempt the stream committed to
	// notBefore is when a pushback lets the next hedge go; zero once a
	// hedge went after it. No timer set for the hedging delay, and no
	// callback of a timer that fired before the pushback, sends it sooner.
	notBefore time.Time
}

// newHedge makes a hedged stream's state.
func (s *retryStream) newHedge() *streamHedge {
	h := &streamHedge{decided: make(chan struct{}),
		hedgeRules: s.ic.hedgeRulesFor(s.p, s.method, targetOf(s.cc), s.bs.lim, s.breaker, s.maxAttempts)}
	s.opts, h.want = splitCatchers(s.opts)
	h.changed = sync.NewCond(&s.mu)
	return h
}

// hedgeNextLocked starts the next attempt if one may go (a hedge needs the
// breaker, the throttling and the budgets to allow it). The first attempt
// opens here, under the lock, before anything else runs on the stream. A
// hedge is only made ready here: next is returned for the caller to open
// with openHedge once it has released the lock, so that a hedge slow to
// open (the connection has no free stream) or to take its replay (flow
// control) holds up no other attempt's answer. It returns the stream's final
// error when no attempt is in flight and none may go any more.
func (s *retryStream) hedgeNextLocked() (over bool, err error, next *streamAttempt) {
	h := s.hedge
	for {
		if s.committed || s.finished {
			return false, nil, nil
		}
		if h.noMore || s.attempts >= h.max || s.ctx.Err() != nil || s.overflow {
			over, err = s.hedgeExhaustedLocked()
			return over, err, nil
		}
		if s.attempts > 0 {
			if h.refused = h.refusal(); h.refused != "" {
				h.noMore = true
				s.ic.metering.refusal(s.ctx, s.method, h.refused)
				over, err = s.hedgeExhaustedLocked()
				return over, err, nil
			}
			return false, nil, s.readyHedgeLocked()
		}
		a, err := s.startLocked()
		if a.notSent != nil {
			return true, s.notSentLocked(a, nil), nil
		}
		if err == nil && s.committed {
			s.hedgeCommitLocked(a, true, false) // it answered during its replay
			return false, nil, nil
		}
		if err == nil {
			h.live = append(h.live, a)
			go s.watchHedge(a)
			s.hedgeArmLocked(h.delay)
			return false, nil, nil
		}
		// It could not open without an answer.
		over, ferr, now := s.hedgeFailedLocked(a, err)
		if over || !now {
			return over, ferr, nil // ended, or waiting for a pushback's delay
		}
	}
}

// readyHedgeLocked numbers the next hedge and makes its context and span;
// it is opening until openHedge makes it live.
func (s *retryStream) readyHedgeLocked() *streamAttempt {
	s.attempts++
	s.hedge.notBefore = time.Time{} // the pushback's wait is over
	a := &streamAttempt{n: s.attempts, live: true}
	if s.ctl != nil {
		s.ctl.Sent() // a hedge goes only while the controller is calm
	}
	if s.hedge.window != nil {
		a.started = s.ic.clock.Now()
	}
	ctx := s.numbers.context(s.ctx, a.n, s.maxAttempts)
	ctx, a.cancel = context.WithCancelCause(ctx)
	if s.tracer != nil {
		ctx, a.span = startAttempt(ctx, s.tracer, s.method, a.n)
		a.span.SetAttributes(telemetry.AttrHedge.Bool(true))
	}
	a.openCtx = ctx
	s.hedge.opening = append(s.hedge.opening, a)
	return a
}

// openHedge opens hedge a, made ready by hedgeNextLocked, and replays to it
// every message the caller has sent, without holding the lock. Messages sent
// meanwhile are buffered, so it replays until, under the lock, it has caught
// up with the buffer and CloseSend; there it goes live, and from then on
// SendMsg sends to it directly. If the stream commits or ends meanwhile, a
// is ended with it and openHedge returns.
func (s *retryStream) openHedge(a *streamAttempt) {
	h := s.hedge
	cs, err := s.streamer(a.openCtx, s.desc, s.cc, s.method, s.opts...)
	a.openCtx = nil
	replayed, closed := 0, false
	var replayedSz int64
	s.mu.Lock()
	for {
		if !slices.Contains(h.opening, a) {
			// The stream committed or ended: hedgeEndLocked ended a.
			s.mu.Unlock()
			return
		}
		if err != nil {
			break
		}
		a.cs = cs
		if replayed == len(s.ends) && closed == s.closeSent {
			s.replayed, s.replayedSz = s.replayed+int64(replayed), s.replayedSz+replayedSz
			h.opening = slices.DeleteFunc(h.opening, func(o *streamAttempt) bool { return o == a })
			h.live = append(h.live, a)
			h.changed.Broadcast()
			go s.watchHedge(a)
			s.hedgeArmLocked(h.delay)
			s.mu.Unlock()
			return
		}
		var (
			msgs  []proto.Message
			sizes []int
		)
		for i := replayed; i < len(s.ends) && err == nil; i++ {
			var (
				m  proto.Message
				sz int
			)
			if m, sz, err = s.decodeLocked(i); err == nil {
				msgs, sizes = append(msgs, m), append(sizes, sz)
			}
		}
		closeNow := s.closeSent
		s.mu.Unlock()
		for i, m := range msgs {
			if err = cs.SendMsg(m); err != nil {
				break
			}
			replayed++
			replayedSz += int64(sizes[i])
		}
		if err == nil && closeNow && !closed {
			_ = cs.CloseSend() // gRPC's CloseSend always returns nil
			closed = true
		}
		s.mu.Lock()
	}
	// It could not open, or it broke during its replay: judge it while it
	// is still opening, so that the stream does not end meanwhile.
	if cs != nil && err == io.EOF {
		s.mu.Unlock()
		end, headers := a.learnEnd()
		s.mu.Lock()
		if !slices.Contains(h.opening, a) {
			s.mu.Unlock()
			return
		}
		err = end
		if headers || end == io.EOF {
			h.opening = slices.DeleteFunc(h.opening, func(o *streamAttempt) bool { return o == a })
			h.changed.Broadcast()
			s.hedgeCommitLocked(a, true, false) // the server answered it
			s.mu.Unlock()
			return
		}
	} else if cs != nil {
		a.clientErr = true // the client's own error, or a message it could not decode
	}
	h.opening = slices.DeleteFunc(h.opening, func(o *streamAttempt) bool { return o == a })
	h.changed.Broadcast()
	s.hedgeGoUnlock(s.hedgeFailedLocked(a, err))
}

// hedgeGoUnlock goes on after an attempt failed without an answer (over,
// ferr and now as hedgeFailedLocked returns them): the stream ends, or the
// next hedge goes now. It releases the lock, and opens that hedge.
func (s *retryStream) hedgeGoUnlock(over bool, ferr error, now bool) {
	var next *streamAttempt
	if !over && now {
		over, ferr, next = s.hedgeNextLocked()
	}
	if over {
		s.finishUnlock(ferr, true)
		return
	}
	s.mu.Unlock()
	if next != nil {
		s.openHedge(next)
	}
}

// hedgeExhaustedLocked ends the stream if no attempt is in flight; its error
// is the last failure's.
func (s *retryStream) hedgeExhaustedLocked() (over bool, err error) {
	h := s.hedge
	h.noMore = true
	if len(h.live) > 0 || len(h.opening) > 0 {
		return false, nil
	}
	outcome := OutcomeExhausted
	switch {
	case s.ctx.Err() != nil:
		s.outcome = contextOutcome(s.ctx.Err())
		return true, status.FromContextError(s.ctx.Err()).Err()
	case h.last == nil: // cannot happen: the first attempt always goes
		return true, status.Error(codes.Internal, "herdguard: a hedged stream sent no attempt")
	case h.stopped:
		outcome = OutcomePushbackStop
	case h.refused != "":
		outcome = OutcomeBudgetExhausted
	}
	s.outcome = outcome
	return true, &RetryError{Attempts: s.attempts, Outcome: outcome, Err: h.last}
}

// watchHedge waits for attempt a's answer or end, and judges it.
func (s *retryStream) watchHedge(a *streamAttempt) {
	md, _ := a.cs.Header()
	var end error
	if md == nil {
		end, _ = a.learnEnd()
	}
	s.mu.Lock()
	if s.committed || s.finished || !slices.Contains(s.hedge.live, a) {
		s.mu.Unlock()
		return
	}
	s.hedge.live = slices.DeleteFunc(s.hedge.live, func(o *streamAttempt) bool { return o == a })
	if md != nil || end == io.EOF {
		if s.hedge.window != nil {
			s.hedge.window.Record(s.ic.clock.Now().Sub(a.started))
		}
		s.hedgeCommitLocked(a, true, false)
		s.mu.Unlock()
		return
	}
	s.hedgeGoUnlock(s.hedgeFailedLocked(a, end))
}

// hedgeFailedLocked judges attempt a, which ended with err before any
// answer: a fatal failure ends the stream; after a non-fatal one the next
// hedge goes at once (now), or after the server's pushback. It returns the
// stream's final error when the stream is over.
func (s *retryStream) hedgeFailedLocked(a *streamAttempt, err error) (over bool, ferr error, now bool) {
	h := s.hedge
	trailer := a.trailerIfOpen()
	s.endAttemptLocked(a, err)
	a.release()
	code := status.Code(err)
	nonFatal := s.p.nonFatalCode(code) && !a.clientErr && !clientSide(err) && s.ctx.Err() == nil
	wait, ok, present := pushback(trailer)
	if (nonFatal || present && !ok) && h.throttle != nil {
		h.throttle.Failure() // gRFC A6: counts as a failure for throttling
	}
	if present && !ok {
		h.noMore, h.stopped = true, true
		s.gaveUpBelow = s.gaveUpBelow || gaveUpBelow(trailer)
	}
	if !nonFatal {
		// A fatal answer ends the stream: it becomes the current attempt,
		// whose error RecvMsg reports.
		s.a = a
		s.outcome = OutcomeNotRetryable
		if s.ctx.Err() != nil {
			s.outcome = contextOutcome(s.ctx.Err())
		}
		s.hedgeEndLocked(a)
		return true, err, false
	}
	h.last = err
	s.a = a // the stream's status, should it end now: the last failure's
	if present && ok {
		if h.noMore || s.attempts >= h.max {
			// No hedge may follow: the pushback has nothing to delay, and
			// with nothing else in flight the stream is over.
			over, ferr := s.hedgeExhaustedLocked()
			return over, ferr, false
		}
		if len(h.live)+len(h.opening) == 0 && s.deadlineBefore(wait) {
			s.outcome = OutcomeDeadline
			return true, &RetryError{Attempts: s.attempts, Outcome: OutcomeDeadline, Err: err}, false
		}
		h.notBefore = s.ic.clock.Now().Add(wait)
		s.hedgeArmLocked(wait)
		return false, nil, false
	}
	s.hedgeStopTimerLocked() // the next hedge goes now; the one after at the delay
	return false, nil, true
}

// trailerIfOpen returns the trailer of an attempt that opened.
func (a *streamAttempt) trailerIfOpen() metadata.MD {
	if a.cs == nil {
		return nil
	}
	return a.cs.Trailer()
}

// deadlineBefore reports whether the stream's deadline comes before d from now.
func (s *retryStream) deadlineBefore(d time.Duration) bool {
	deadline, ok := s.ctx.Deadline()
	return ok && s.ic.clock.Now().Add(d).After(deadline)
}

// hedgeCommitLocked commits the stream to attempt a and ends every other;
// answered says a's server answered (the breaker hears a success), and
// overflow that the buffer did.
func (s *retryStream) hedgeCommitLocked(a *streamAttempt, answered, overflow bool) {
	s.a = a
	s.hedge.winner = a.n
	if answered {
		s.hedge.hedges.Call() // an answer earns hedges
		s.answeredLocked()
	} else {
		s.commitLocked(overflow)
	}
	s.hedgeEndLocked(a)
}

// hedgeEndLocked ends hedging: the timer stops, every attempt but keep is
// released, and the caller's waiting RecvMsg or Header goes on.
func (s *retryStream) hedgeEndLocked(keep *streamAttempt) {
	h := s.hedge
	h.noMore = true
	s.hedgeStopTimerLocked()
	for _, o := range h.live {
		if o != keep {
			s.endAttemptLocked(o, status.Error(codes.Canceled, "herdguard: another attempt answered first"))
			o.release()
		}
	}
	h.live = nil
	for _, o := range h.opening {
		s.endAttemptLocked(o, status.Error(codes.Canceled, "herdguard: another attempt answered first"))
		o.release()
	}
	h.opening = nil
	h.changed.Broadcast()
	select {
	case <-h.decided:
	default:
		close(h.decided)
	}
}

// hedgeArmLocked sets the timer to start the next hedge after d, or when
// a pushback lets it go if that is later.
func (s *retryStream) hedgeArmLocked(d time.Duration) {
	h := s.hedge
	if h.noMore || s.attempts >= h.max {
		return
	}
	if !h.notBefore.IsZero() {
		d = max(d, h.notBefore.Sub(s.ic.clock.Now()))
	}
	if h.timer == nil {
		h.timer = s.ic.clock.AfterFunc(d, s.hedgeTimer)
		return
	}
	h.timer.Reset(d)
}

func (s *retryStream) hedgeStopTimerLocked() {
	if h := s.hedge; h.timer != nil {
		h.timer.Stop()
	}
}

// hedgeTimer is the timer's callback: the hedging delay passed. A callback
// of a timer that fired just before a pushback set it again does nothing:
// the timer runs again when the pushback lets the hedge go.
func (s *retryStream) hedgeTimer() {
	s.mu.Lock()
	if h := s.hedge; !h.notBefore.IsZero() && s.ic.clock.Now().Before(h.notBefore) {
		s.mu.Unlock()
		return
	}
	s.hedgeGoUnlock(false, nil, true)
}

// hedgeSendLocked sends m to every attempt in flight, after keeping it for
// the hedges to come; if it does not fit the buffer, the stream commits to
// its oldest attempt in flight first, and m goes there alone.
func (s *retryStream) hedgeSendLocked(m any) error {
	h := s.hedge
	// With no attempt in flight but a hedge opening, m waits for it, as
	// gRPC's SendMsg waits for a retry's new attempt: should m overflow the
	// buffer, the stream commits to an attempt in flight, and the hedge
	// needs the whole buffer to catch up first.
	for len(h.live) == 0 && len(h.opening) > 0 && !s.committed && !s.finished {
		h.changed.Wait()
	}
	if s.committed || s.finished { // it answered, or the stream ended, meanwhile
		a := s.a
		s.mu.Unlock()
		return s.sendCommitted(a, m)
	}
	s.bufferLocked(m)
	if s.committed { // the buffer overflowed
		// The attempts in flight have every message.
		if len(h.live) > 0 {
			s.hedgeCommitLocked(h.live[0], false, true)
		} else if over, err := s.hedgeExhaustedLocked(); over {
			// Every attempt has failed and none is opening (the next
			// waits for a pushback): the stream ends with the last
			// failure, as it would once no hedge may follow.
			s.committed = false // to no attempt: RecvMsg reports err
			s.finishUnlock(err, true)
			return io.EOF
		} else {
			s.hedgeEndLocked(nil) // cannot be: nothing is in flight or opening
		}
		a := s.a
		s.mu.Unlock()
		return s.sendCommitted(a, m)
	}
	s.sent++
	h.sendTo = append(h.sendTo[:0], h.live...)
	to := h.sendTo
	s.mu.Unlock()
	for _, a := range to {
		// io.EOF: the attempt is over, and its watcher judges it.
		if err := a.cs.SendMsg(m); err != nil && err != io.EOF {
			s.mu.Lock()
			a.clientErr = true
			s.hedgeEndLocked(a)
			s.a = a
			s.finishUnlock(err, true)
			return err
		}
	}
	return nil
}

// hedgeCommitNowUnlock commits a hedged stream that has not answered yet
// (Context, Trailer), as gRPC commits a stream to its current attempt: to
// its oldest attempt in flight. With none in flight but a hedge opening, it
// waits for that hedge; with none at all (every attempt failed, and the
// next waits for a pushback's delay) the stream ends with the last failure,
// as gRPC's would with a failed current attempt. No hedge starts after. It
// releases the lock.
func (s *retryStream) hedgeCommitNowUnlock() {
	if !s.hedgeCommitOldestLocked() && !s.committed && !s.finished {
		if over, err := s.hedgeExhaustedLocked(); over {
			s.finishUnlock(err, true)
			return
		}
	}
	s.mu.Unlock()
}

// hedgeCommitOldestLocked commits the stream to its oldest attempt in
// flight, waiting for a hedge being opened if no other is in flight. No
// hedge starts after. It reports false if no attempt is in flight, or the
// stream committed or ended while it waited.
func (s *retryStream) hedgeCommitOldestLocked() bool {
	h := s.hedge
	h.noMore = true
	for len(h.live) == 0 && len(h.opening) > 0 && !s.committed && !s.finished {
		h.changed.Wait()
	}
	if s.committed || s.finished || len(h.live) == 0 {
		return false
	}
	s.hedgeCommitLocked(h.live[0], false, false)
	return true
}

// waitHedged waits, before commit, until a hedged stream commits or ends.
func (s *retryStream) waitHedged() {
	if h := s.hedge; h != nil {
		<-h.decided
	}
}
