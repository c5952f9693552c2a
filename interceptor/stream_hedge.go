package interceptor

import (
	"context"
	"io"
	"slices"
	"sync"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/internal/pacing"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// streamHedging is how a hedged stream (gRFC A6 hedging) runs its attempts
// until it commits: the strategy its clientStream holds, which shares the
// stream's replay buffer, lock, attempts and ending, run by the hedger
// (sched). Until the stream commits, every attempt in flight gets every
// message the caller sends, and a new hedge gets the replay buffer first,
// opened and replayed to without the stream's lock (openHedge) so that it
// holds up no other attempt, until it has caught up and joins the others.
// A goroutine per attempt waits for its response headers: the first
// attempt to answer wins the stream, which commits to it and cancels the
// others; the caller's RecvMsg and Header wait for that. An attempt that
// ends without headers is judged by the hedger, as a hedged unary call's
// attempt is. Once the replay buffer overflows (or the caller calls
// Context), the stream commits to its oldest attempt in flight, which has
// every message, and no hedge starts; with none in flight it waits for a
// hedge being opened, and with none opening either it ends with the last
// failure. Once committed, the stream runs as a retried one does.
type streamHedging struct {
	s       *clientStream
	decided chan struct{} // closed once the stream commits or ends

	// want are where the caller's Header, Trailer and Peer options point;
	// the stream's attempts run without them, and the stream fills them
	// from its final attempt when it ends.
	want callerCatchers

	// guarded by the stream's mu
	sched   hedger
	live    []*streamAttempt // attempts open and not ended, oldest first
	opening []*streamAttempt // hedges being opened and replayed to, without the lock
	changed *sync.Cond       // on the stream's mu: an opening hedge went live or ended
	sendTo  []*streamAttempt // sendMsg's copy of live
	winner  int              // the number of the attempt the stream committed to
}

// startHedged makes s a hedged stream and sends its first attempt.
func (s *clientStream) startHedged() (grpc.ClientStream, error) {
	h := &streamHedging{s: s, decided: make(chan struct{})}
	s.opts, h.want = splitCatchers(s.opts)
	h.changed = sync.NewCond(&s.mu)
	h.sched.call, h.sched.fire = h, h.onTimer
	h.sched.startLocked(s.ic, s.p, s.ic.hedgeRulesFor(s.p, s.method, s.bs.target, s.bs.lim, s.breaker, s.maxAttempts))
	s.hedged = h

	s.mu.Lock()
	over, err, next := h.goLocked(h.sched.nextLocked(s.ctx))
	if over {
		s.finishUnlock(err, true)
		return nil, err
	}
	// Under the lock, so that a context already done cannot finish the
	// stream before unwatch is set.
	s.unwatch = context.AfterFunc(s.ctx, s.contextDone)
	s.mu.Unlock()
	if next != nil {
		go h.openHedge(next) // the first attempt failed at once
	}
	return s, nil
}

// attemptsLocked tells the hedger the attempts sent and in flight.
func (h *streamHedging) attemptsLocked() (sent, inFlight int) {
	s := h.s
	return s.attempts, len(h.live) + len(h.opening)
}

// names tells the hedger the stream's method and target.
func (h *streamHedging) names() (method, target string) { return h.s.method, h.s.bs.target }

// goLocked does what the hedger said (v), until the stream waits: the
// first attempt opens here, under the lock, before anything else runs on
// the stream, and is judged at once if it fails to open. A hedge is only
// made ready here: next is returned for the caller to open with openHedge
// once it has released the lock, so that a hedge slow to open (the
// connection has no free stream) or to take its replay (flow control)
// holds up no other attempt's answer. It returns the stream's final error
// when the stream is over.
func (h *streamHedging) goLocked(v hedgeVerdict) (over bool, err error, next *streamAttempt) {
	s := h.s
	for {
		if !s.state.isOpen() {
			return false, nil, nil
		}
		switch v.step {
		case hedgeWait:
			return false, nil, nil
		case hedgeFatal, hedgeOver:
			if v.outcome != "" {
				s.outcome = v.outcome
			}
			if v.step == hedgeFatal {
				h.endHedgingLocked(s.a) // the failed attempt is current: RecvMsg reports its error
			}
			return true, v.err, nil
		}
		if s.attempts > 0 {
			return false, nil, h.readyHedgeLocked()
		}
		a, err := s.startLocked()
		if a.notSent != nil {
			return true, s.notSentLocked(a, nil), nil
		}
		if err == nil && s.state.isCommitted() {
			h.commitToLocked(a, true, false) // it answered during its replay
			return false, nil, nil
		}
		if err == nil {
			h.live = append(h.live, a)
			go h.watchHedge(a)
			h.sched.armLocked(h.sched.delay)
			return false, nil, nil
		}
		v = h.failedLocked(a, err) // it could not open without an answer
	}
}

// goOnUnlock does what the hedger said after an attempt failed or the
// timer fired: the stream ends, or the next hedge goes now. It releases
// the lock, and opens that hedge.
func (h *streamHedging) goOnUnlock(v hedgeVerdict) {
	s := h.s
	over, err, next := h.goLocked(v)
	if over {
		s.finishUnlock(err, true)
		return
	}
	s.mu.Unlock()
	if next != nil {
		h.openHedge(next)
	}
}

// onTimer is the timer's callback: the hedging delay, or a pushback's,
// passed.
func (h *streamHedging) onTimer() {
	s := h.s
	s.mu.Lock()
	if !s.state.isOpen() {
		s.mu.Unlock()
		return
	}
	h.goOnUnlock(h.sched.timerLocked(s.ctx))
}

// readyHedgeLocked numbers the next hedge and makes its context and span;
// it is opening until openHedge makes it live.
func (h *streamHedging) readyHedgeLocked() *streamAttempt {
	s := h.s
	s.attempts++
	a := &streamAttempt{n: s.attempts}
	_ = s.ic.take(s.ctx, nil, s.ctl, s.method, s.bs.target, a.n, pacing.Aside, &a.ticket) // a hedge goes only while calm: never held
	a.ticket.untimed = true
	if h.sched.window != nil {
		a.started = s.ic.clock.Now()
	}
	ctx := s.numbers.context(s.ctx, a.n, s.maxAttempts)
	ctx, a.cancel = context.WithCancelCause(ctx)
	if s.tracer != nil {
		ctx, a.span = startAttempt(ctx, s.tracer, s.method, a.n)
		a.span.SetAttributes(telemetry.AttrHedge.Bool(true))
	}
	a.openCtx = ctx
	h.opening = append(h.opening, a)
	return a
}

// openHedge opens hedge a, made ready by goLocked, and replays to it every
// message the caller has sent, without holding the lock. Messages sent
// meanwhile are buffered, so it replays until, under the lock, it has caught
// up with the buffer and CloseSend; there it goes live, and from then on
// SendMsg sends to it directly. If the stream commits or ends meanwhile, a
// is ended with it and openHedge returns.
func (h *streamHedging) openHedge(a *streamAttempt) {
	s := h.s
	cs, err := s.streamer(a.openCtx, s.desc, s.cc, s.method, s.opts...)
	a.openCtx = nil
	replayed, closed := 0, false
	var replayedSz int64
	s.mu.Lock()
	for {
		if !slices.Contains(h.opening, a) {
			// The stream committed or ended: endHedgingLocked ended a.
			s.mu.Unlock()
			return
		}
		if err != nil {
			break
		}
		a.cs = cs
		if replayed == s.replay.len() && closed == s.closeSent {
			s.replayed, s.replayedSz = s.replayed+int64(replayed), s.replayedSz+replayedSz
			h.dropOpeningLocked(a)
			h.live = append(h.live, a)
			go h.watchHedge(a)
			h.sched.armLocked(h.sched.delay)
			s.mu.Unlock()
			return
		}
		var (
			msgs  []proto.Message
			sizes []int
		)
		for i := replayed; i < s.replay.len() && err == nil; i++ {
			var (
				m  proto.Message
				sz int
			)
			if m, sz, err = s.replay.message(i); err == nil {
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
			h.dropOpeningLocked(a)
			h.commitToLocked(a, true, false) // the server answered it
			s.mu.Unlock()
			return
		}
	} else if cs != nil {
		a.clientErr = true // the client's own error, or a message it could not decode
	}
	h.dropOpeningLocked(a)
	h.goOnUnlock(h.failedLocked(a, err))
}

// dropOpeningLocked takes a, which went live or ended, off the hedges
// being opened.
func (h *streamHedging) dropOpeningLocked(a *streamAttempt) {
	h.opening = slices.DeleteFunc(h.opening, func(o *streamAttempt) bool { return o == a })
	h.changed.Broadcast()
}

// watchHedge waits for attempt a's answer or end, and judges it.
func (h *streamHedging) watchHedge(a *streamAttempt) {
	s := h.s
	md, _ := a.cs.Header()
	var end error
	if md == nil {
		end, _ = a.learnEnd()
	}
	s.mu.Lock()
	if !s.state.isOpen() || !slices.Contains(h.live, a) {
		s.mu.Unlock()
		return
	}
	h.live = slices.DeleteFunc(h.live, func(o *streamAttempt) bool { return o == a })
	if md != nil || end == io.EOF {
		if h.sched.window != nil {
			h.sched.window.Record(s.ic.clock.Now().Sub(a.started))
		}
		h.commitToLocked(a, true, false)
		s.mu.Unlock()
		return
	}
	h.goOnUnlock(h.failedLocked(a, end))
}

// failedLocked ends attempt a, which ended with err before any answer, and
// has the hedger judge it. a becomes the current attempt: the stream's
// status, should it end now.
func (h *streamHedging) failedLocked(a *streamAttempt, err error) hedgeVerdict {
	s := h.s
	trailer := a.trailerIfOpen()
	a.gaveUpBelow = err != nil && gaveUpBelow(trailer)
	s.endAttemptLocked(a, err)
	a.release()
	v := h.sched.failedLocked(s.ctx, err, trailer, false, a.clientErr)
	s.gaveUpBelow = h.sched.gaveUpBelow // the latest failure's
	s.a = a
	return v
}

// trailerIfOpen returns the trailer of an attempt that opened.
func (a *streamAttempt) trailerIfOpen() metadata.MD {
	if a.cs == nil {
		return nil
	}
	return a.cs.Trailer()
}

// commitToLocked commits the stream to attempt a and ends every other;
// answered says a's server answered (the breaker hears a success), and
// overflow that the buffer did.
func (h *streamHedging) commitToLocked(a *streamAttempt, answered, overflow bool) {
	s := h.s
	s.a = a
	h.winner = a.n
	if answered {
		h.sched.answeredLocked() // an answer earns hedges
		s.answeredLocked()
	} else {
		s.commitLocked(overflow)
	}
	h.endHedgingLocked(a)
}

// endHedgingLocked ends hedging: the timer stops, every attempt but keep
// is released, and the caller's waiting RecvMsg or Header goes on. It does
// nothing for a stream that is not hedged (s nil).
func (h *streamHedging) endHedgingLocked(keep *streamAttempt) {
	if h == nil {
		return
	}
	s := h.s
	h.sched.endLocked()
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

// sendMsg sends m to every attempt in flight, after keeping it for the
// hedges to come; if it does not fit the buffer, the stream commits to its
// oldest attempt in flight first, and m goes there alone. It reports false,
// having sent nothing, once the stream has committed or ended: m goes as
// on a retried stream.
func (h *streamHedging) sendMsg(m any) (err error, sent bool) {
	s := h.s
	s.mu.Lock()
	if !s.state.isOpen() {
		s.mu.Unlock()
		return nil, false
	}
	// With no attempt in flight but a hedge opening, m waits for it, as
	// gRPC's SendMsg waits for a retry's new attempt: should m overflow the
	// buffer, the stream commits to an attempt in flight, and the hedge
	// needs the whole buffer to catch up first.
	for len(h.live) == 0 && len(h.opening) > 0 && s.state.isOpen() {
		h.changed.Wait()
	}
	if !s.state.isOpen() { // it answered, or the stream ended, meanwhile
		a := s.a
		s.mu.Unlock()
		return s.sendCommitted(a, m), true
	}
	if !s.bufferLocked(m) { // the buffer overflowed
		// The attempts in flight have every message.
		if len(h.live) > 0 {
			h.commitToLocked(h.live[0], false, true)
		} else if v := h.sched.stopLocked(s.ctx); v.step == hedgeOver {
			// Every attempt has failed and none is opening (the next
			// waits for a pushback): the stream ends with the last
			// failure, as it would once no hedge may follow.
			s.overflow = true
			h.endOverUnlock(v)
			return io.EOF, true
		} else {
			s.commitLocked(true) // cannot be: nothing is in flight or opening
			h.endHedgingLocked(nil)
		}
		a := s.a
		s.mu.Unlock()
		return s.sendCommitted(a, m), true
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
			h.endHedgingLocked(a)
			s.a = a
			s.finishUnlock(err, true)
			return err, true
		}
	}
	return nil, true
}

// endOverUnlock ends the stream as the hedger said, once no attempt is in
// flight and none may follow (v.step is hedgeOver). It releases the lock.
func (h *streamHedging) endOverUnlock(v hedgeVerdict) {
	s := h.s
	if v.outcome != "" {
		s.outcome = v.outcome
	}
	s.finishUnlock(v.err, true)
}

// closeSend closes the sending side of every attempt in flight, outside
// the lock, as sendMsg sends: a hedge opening meanwhile closes its own
// once it has caught up. It reports false, having done nothing, once the
// stream has committed or ended, or was closed already.
func (h *streamHedging) closeSend() bool {
	s := h.s
	s.mu.Lock()
	if s.closeSent || !s.state.isOpen() {
		s.mu.Unlock()
		return false
	}
	s.closeSent = true
	h.sendTo = append(h.sendTo[:0], h.live...)
	to := h.sendTo
	s.mu.Unlock()
	for _, a := range to {
		_ = a.cs.CloseSend()
	}
	return true
}

// commitNow commits a hedged stream that has not answered yet (Context,
// Trailer), as gRPC commits a stream to its current attempt: to its oldest
// attempt in flight. With none in flight but a hedge opening, it waits for
// that hedge; with none at all (every attempt failed, and the next waits
// for a pushback's delay) the stream ends with the last failure, as gRPC's
// would with a failed current attempt. No hedge starts after.
func (h *streamHedging) commitNow() {
	s := h.s
	s.mu.Lock()
	if !s.state.isOpen() {
		s.mu.Unlock()
		return
	}
	h.sched.noMore = true
	for len(h.live) == 0 && len(h.opening) > 0 && s.state.isOpen() {
		h.changed.Wait()
	}
	switch {
	case !s.state.isOpen():
	case len(h.live) > 0:
		h.commitToLocked(h.live[0], false, false)
	default:
		if v := h.sched.stopLocked(s.ctx); v.step == hedgeOver {
			h.endOverUnlock(v)
			return
		}
	}
	s.mu.Unlock()
}

// The parts of a stream's end that hedging adds; each does nothing for a
// stream that is not hedged (h nil).

// roleOf tells whether attempt n was a hedge, and whether it won.
func (h *streamHedging) roleOf(n int) (hedge, won bool) {
	if h == nil {
		return false, false
	}
	return n > 1, h.winner == n
}

// timed reports whether attempts' latencies are recorded, for a
// latency-aware delay.
func (h *streamHedging) timed() bool { return h != nil && h.sched.window != nil }

// fillCatchers fills the caller's Header, Trailer and Peer options, which
// no attempt carried, from a, the final attempt, as gRPC fills them at the
// end.
func (h *streamHedging) fillCatchers(a *streamAttempt) {
	if h == nil || !h.want.any() || a.cs == nil {
		return
	}
	header, _ := a.cs.Header()
	p, _ := peer.FromContext(a.cs.Context())
	h.want.fill(header, a.cs.Trailer(), p)
}

// spanAttributes sets the call span's hedging attributes.
func (h *streamHedging) spanAttributes(span trace.Span, attempts int) {
	if h == nil {
		return
	}
	span.SetAttributes(names.AttrHedges.Int(max(attempts-1, 0))) // 0 attempts: none sent
	if h.winner > 0 {
		span.SetAttributes(names.AttrHedgeWinner.Int(h.winner))
	}
}
