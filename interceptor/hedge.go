package interceptor

import (
	"cmp"
	"context"
	"reflect"
	"sync"
	"time"

	"github.com/herdguard/herdguard/internal/pacing"

	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/budget"
	"github.com/herdguard/herdguard/internal/latency"
)

// hedgeCall is one hedged unary call (gRFC A6's hedging policy). Its first
// attempt runs on the caller's goroutine, each hedge on a goroutine of its
// own. When each goes, and how a failed one is judged, is the hedger's
// (sched). The first answer (a reply, or a fatal failure) decides the call
// and cancels every other attempt; the caller sees exactly that answer. If
// every attempt fails non-fatally and no more may go, the last failure
// decides it.
//
// hedgeCalls are pooled per interceptor with their first attempt, their
// channel and their timer, so that a call answered before its hedging delay
// allocates only its first attempt's cancellable context. One goes back to
// the pool only once nothing refers to it: every hedge's goroutine and every
// timer callback has ended (wg).
type hedgeCall struct {
	// c is a copy of the call, so that an unhedged call, which never gets
	// here, does not escape to the heap.
	c   unaryCall
	ctx context.Context
	// opts are the caller's call options for every attempt, without the
	// caller's Header, Trailer and Peer options (want): gRPC would fill
	// those from each attempt as it ends, losers last. The call fills them
	// from the attempt that decided it.
	opts []grpc.CallOption
	want callerCatchers
	// replyType (for a protobuf reply) or replyElem is the type of the
	// caller's reply, for hedges' replies. They are read before the first
	// attempt starts writing into the caller's reply, which must not be read
	// after.
	replyType protoreflect.MessageType
	replyElem reflect.Type
	done      chan struct{}    // one value once the call is decided
	first     hedgeAttempt     // the first attempt
	inline    [4]*hedgeAttempt // attempts' first backing array
	// wg counts the hedges' goroutines and the timer's pending or running
	// callbacks, so that none outlives the call.
	wg sync.WaitGroup

	// mu guards the fields below. It is never held while an attempt runs.
	mu          sync.Mutex
	sched       hedger // with its timer, kept with the pooled call
	attempts    []*hedgeAttempt
	outstanding int
	decided     bool          //
	winner      *hedgeAttempt // the attempt that decided the call; nil if all failed
	err         error         // the call's error
	lastBy      *hedgeAttempt // the attempt that failed with the last non-fatal failure
	numbers     retryNumbers
}

// hedgeAttempt is one attempt of a hedged call.
type hedgeAttempt struct {
	n               int
	ctx             context.Context
	cancel          context.CancelFunc
	reply           any
	opts            []grpc.CallOption
	header, trailer *metadata.MD
	own             struct {
		header, trailer metadata.MD // a hedge's catchers
		peer            peer.Peer   // when the caller asked for the peer
	}
	span   trace.Span
	start  time.Time // when it went, for a latency-aware delay
	ticket ticket
}

func newHedgeCall() any {
	h := &hedgeCall{done: make(chan struct{}, 1)}
	h.sched.call, h.sched.fire, h.sched.wg = h, h.onTimer, &h.wg
	return h
}

// hedge makes a hedged call of at most maxAttempts attempts and returns its
// error. It sets c.attempts, c.outcome, c.hedges and c.winner.
func (c *unaryCall) hedge(ctx context.Context, maxAttempts int, t *ticket) error {
	h := c.ic.hedgeCalls.Get().(*hedgeCall)
	defer h.release(c.ic)
	h.c, h.ctx = *c, ctx
	h.sched.startLocked(c.ic, c.p, c.ic.hedgeRulesFor(c.p, c.method, c.target, c.lim, c.breaker, maxAttempts))
	h.attempts = h.inline[:0]
	n := len(c.buf.opts) - catchers
	h.opts, h.want = splitCatchers(c.buf.opts[:n:n]) // capped: appends must not write over the catchers
	if m, ok := c.reply.(proto.Message); ok {
		h.replyType = m.ProtoReflect().Type()
	} else {
		h.replyElem = reflect.TypeOf(c.reply).Elem()
	}

	h.mu.Lock()
	first := h.newAttemptLocked(1)
	first.ticket = *t
	h.outstanding = 1
	h.sched.armLocked(h.sched.delay)
	h.mu.Unlock()
	h.report(first, h.run(first))

	select {
	case <-h.done: // most often: the first attempt decided the call
	default:
		select {
		case <-h.done:
		case <-ctx.Done():
			// Attempts in flight end with the context and decide the call;
			// one waiting for a pushback's delay would not.
			h.mu.Lock()
			if !h.decided {
				h.decideLocked(nil, status.FromContextError(ctx.Err()).Err(), contextOutcome(ctx.Err()))
			}
			h.mu.Unlock()
			<-h.done
		}
	}
	// The call is decided, which stopped the timer (decideLocked), and no
	// hedge goes after it.
	h.wg.Wait() // every loser has ended: the reply is the winner's alone

	h.mu.Lock()
	defer h.mu.Unlock()
	c.outcome, c.clientErr, c.gaveUpBelow = h.c.outcome, h.c.clientErr, h.sched.gaveUpBelow
	c.attempts, c.hedges = len(h.attempts), len(h.attempts)-1
	if w := h.winner; w != nil && h.err == nil {
		c.winner = w.n
		if w != first {
			copyReply(c.reply, w.reply)
		}
	}
	if by := cmp.Or(h.winner, h.lastBy); by != nil {
		h.want.fill(*by.header, *by.trailer, &by.own.peer)
	}
	if h.err == nil {
		c.outcome = OutcomeOK
		if h.sched.throttle != nil {
			h.sched.throttle.Success()
		}
	}
	return h.err
}

// newAttemptLocked makes attempt n: the first uses the caller's reply and
// the call's pooled catchers, a hedge a reply and catchers of its own.
func (h *hedgeCall) newAttemptLocked(n int) *hedgeAttempt {
	c := &h.c
	var a *hedgeAttempt
	ctx := h.ctx
	if n == 1 {
		h.first = hedgeAttempt{n: 1}
		a = &h.first
		a.reply = c.reply
		a.header, a.trailer = &c.buf.header, &c.buf.trailer
	} else {
		a = &hedgeAttempt{n: n}
		ctx = h.numbers.context(ctx, n, h.sched.max)
		if h.replyType != nil {
			a.reply = h.replyType.New().Interface()
		} else {
			a.reply = reflect.New(h.replyElem).Interface()
		}
		a.header, a.trailer = &a.own.header, &a.own.trailer
	}
	if n == 1 && !h.want.any() {
		a.opts = c.buf.opts // the caller's, then the call's pooled catchers
	} else {
		a.opts = append(h.opts[:len(h.opts):len(h.opts)], grpc.Header(a.header), grpc.Trailer(a.trailer))
	}
	if h.want.peer != nil {
		a.opts = append(a.opts[:len(a.opts):len(a.opts)], grpc.Peer(&a.own.peer))
	}
	a.ctx, a.cancel = context.WithCancel(ctx)
	h.attempts = append(h.attempts, a)
	return a
}

// run sends attempt a and returns its error.
func (h *hedgeCall) run(a *hedgeAttempt) error {
	c := &h.c
	ctx := a.ctx
	if c.tracer != nil {
		ctx, a.span = startAttempt(ctx, c.tracer, c.method, a.n)
		if a.n > 1 {
			a.span.SetAttributes(telemetry.AttrHedge.Bool(true))
		}
	}
	if a.n > 1 {
		_ = c.ic.take(ctx, nil, c.ctl, c.method, c.target, a.n, pacing.Aside, &a.ticket) // a hedge goes only while calm: never held
	}
	if h.sched.window != nil {
		a.start = c.ic.clock.Now()
	}
	return c.invoker(ctx, c.method, c.req, a.reply, c.cc, a.opts...)
}

// report judges the end of attempt a: it may decide the call, or send the
// next hedge at once. Then it records the attempt.
func (h *hedgeCall) report(a *hedgeAttempt, err error) {
	c := &h.c
	var elapsed time.Duration
	if !a.start.IsZero() {
		elapsed = c.ic.clock.Now().Sub(a.start)
	}
	h.mu.Lock()
	h.outstanding--
	if !h.decided {
		h.judgeLocked(a, err)
	}
	won := h.winner == a && err == nil
	h.mu.Unlock()
	a.cancel()
	if err == nil && h.sched.window != nil {
		h.sched.window.Record(elapsed) // an attempt cancelled as a loser ends with an error
	}
	c.ic.finish(h.ctx, c.method, c.target, &a.ticket, &attemptEnd{n: a.n, err: err, trailer: *a.trailer, span: a.span}, a.n > 1, won)
}

// judgeLocked decides the call on attempt a's end, or goes on hedging.
func (h *hedgeCall) judgeLocked(a *hedgeAttempt, err error) {
	if err == nil {
		h.sched.answeredLocked()
		h.decideLocked(a, nil, OutcomeOK)
		return
	}
	v := h.sched.failedLocked(h.ctx, err, *a.trailer, *a.header != nil, false)
	if v.step != hedgeFatal {
		h.lastBy = a
	}
	h.goOnLocked(a, v)
}

// goOnLocked does what the hedger said, after attempt a (nil: the timer).
func (h *hedgeCall) goOnLocked(a *hedgeAttempt, v hedgeVerdict) {
	switch v.step {
	case hedgeSend:
		h.sendLocked()
	case hedgeFatal:
		if v.outcome == OutcomeNotRetryable {
			h.c.clientErr = clientSide(v.err)
		}
		h.decideLocked(a, v.err, v.outcome)
	case hedgeOver:
		h.decideLocked(nil, v.err, v.outcome)
	}
}

// decideLocked ends the call with err, decided by attempt a (nil when all
// failed), and cancels every other attempt.
func (h *hedgeCall) decideLocked(a *hedgeAttempt, err error, outcome Outcome) {
	if h.decided {
		return
	}
	h.decided, h.winner, h.err, h.c.outcome = true, a, err, outcome
	h.sched.endLocked()
	for _, o := range h.attempts {
		if o != a {
			o.cancel()
		}
	}
	h.done <- struct{}{}
}

// sendLocked sends the next hedge, which the hedger let go, and arms the
// timer for the one after.
func (h *hedgeCall) sendLocked() {
	a := h.newAttemptLocked(len(h.attempts) + 1)
	h.outstanding++
	// The timer for the one after is armed before the hedge goes, so that
	// it is set by the time the hedge can reach the server.
	h.sched.armLocked(h.sched.delay)
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		h.report(a, h.run(a))
	}()
}

// attemptsLocked tells the hedger the attempts sent and in flight.
func (h *hedgeCall) attemptsLocked() (sent, inFlight int) { return len(h.attempts), h.outstanding }

// names tells the hedger the call's method and target.
func (h *hedgeCall) names() (method, target string) { return h.c.method, h.c.target }

// onTimer is the timer's callback: the hedging delay, or a pushback's,
// passed.
func (h *hedgeCall) onTimer() {
	defer h.wg.Done()
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.decided {
		h.goOnLocked(nil, h.sched.timerLocked(h.ctx))
	}
}

// release returns h to ic's pool once nothing refers to it any more: the
// caller has waited for every hedge and timer callback (wg). What the call
// held is dropped; the channel, the timer and the backing arrays stay.
func (h *hedgeCall) release(ic *Interceptor) {
	done, call, fire, wg, t := h.done, h.sched.call, h.sched.fire, h.sched.wg, h.sched.timer
	*h = hedgeCall{done: done} // one write of the whole call; the scheduler keeps what startLocked keeps
	h.sched.call, h.sched.fire, h.sched.wg, h.sched.timer = call, fire, wg, t
	ic.hedgeCalls.Put(h)
}

// copyReply makes dst, the caller's reply, hold the winning hedge's src.
func copyReply(dst, src any) {
	if d, ok := dst.(proto.Message); ok {
		proto.Reset(d)
		proto.Merge(d, src.(proto.Message))
		return
	}
	reflect.ValueOf(dst).Elem().Set(reflect.ValueOf(src).Elem())
}

// hedgeable reports whether a hedge can be made for a call whose reply is
// reply: its type must be known to make another.
func hedgeable(reply any) bool {
	if _, ok := reply.(proto.Message); ok {
		return true
	}
	t := reflect.TypeOf(reply)
	return t != nil && t.Kind() == reflect.Pointer
}

// hedgeRules decide when a hedged call's or stream's next hedge goes, and
// whether it may.
type hedgeRules struct {
	max      int
	delay    time.Duration
	window   *latency.Window    // nil: a fixed delay
	hedges   *budget.Ratio      // the target's hedge budget, earned by successes
	ratio    *budget.Ratio      // nil: no WithRetryBudget
	throttle *budget.Throttle   // nil: no throttling
	breaker  *breaker.Breaker   // nil: none
	ctl      *pacing.Controller // nil: no overload control
}

// hedgeRulesFor returns the rules of a call to target's method under p, of
// at most max attempts, through breaker b (nil: none); the call counts in
// the retry budget, if on. The delay is the quantile of the method's
// recent latencies, if p asks for one, never below p's Delay.
func (ic *Interceptor) hedgeRulesFor(p *resolved, method, target string, lim *limits, b *breaker.Breaker, max int) hedgeRules {
	r := hedgeRules{max: max, window: ic.window(p, method), hedges: ic.hedgeBudget(target), breaker: b, ctl: ic.controllerFor(target)}
	if lim != nil {
		r.ratio, r.throttle = lim.ratio, lim.throttle
	}
	var q time.Duration
	known := false
	if r.window != nil {
		q, known = r.window.Quantile()
	}
	r.delay = p.p.Hedging.HedgeDelay(q, known)
	if r.ratio != nil {
		r.ratio.Call()
	}
	return r
}

// refusal returns what refuses the next hedge now ("breaker": the server
// shows failures; "overload": the overload controller is pacing the
// target; "throttling", "hedge_budget" or "ratio"), or "" if it
// may go, and is then counted in the budgets. The hedge budget is only
// peeked at before the retry budget is asked, so that a hedge the retry
// budget refuses costs none of it.
func (r *hedgeRules) refusal() string {
	switch {
	case r.breaker != nil && !r.breaker.Calm():
		return "breaker"
	case paces(r.ctl):
		return "overload"
	case r.throttle != nil && !r.throttle.Allowed():
		return "throttling"
	case !r.hedges.Allowed():
		return "hedge_budget"
	case r.ratio != nil && !r.ratio.TryRetry():
		return "ratio"
	case !r.hedges.TryRetry(): // only if another call took the last room meanwhile
		return "hedge_budget"
	}
	return ""
}

// callerCatchers are where a caller's Header, Trailer and Peer call options
// point; nil where it gave none.
type callerCatchers struct {
	header, trailer *metadata.MD
	peer            *peer.Peer
}

func (w callerCatchers) any() bool { return w.header != nil || w.trailer != nil || w.peer != nil }

// fill gives the caller the header, trailer and peer of the attempt that
// decided its call.
func (w callerCatchers) fill(header, trailer metadata.MD, p *peer.Peer) {
	if w.header != nil {
		*w.header = header
	}
	if w.trailer != nil {
		*w.trailer = trailer
	}
	if w.peer != nil && p != nil {
		*w.peer = *p
	}
}

// splitCatchers returns opts without the caller's Header, Trailer and Peer
// options, and where those point. It allocates only when there are any.
func splitCatchers(opts []grpc.CallOption) ([]grpc.CallOption, callerCatchers) {
	var w callerCatchers
	found := false
	for _, o := range opts {
		switch o := o.(type) {
		case grpc.HeaderCallOption:
			w.header, found = o.HeaderAddr, true
		case grpc.TrailerCallOption:
			w.trailer, found = o.TrailerAddr, true
		case grpc.PeerCallOption:
			w.peer, found = o.PeerAddr, true
		}
	}
	if !found {
		return opts, w
	}
	kept := make([]grpc.CallOption, 0, len(opts))
	for _, o := range opts {
		switch o.(type) {
		case grpc.HeaderCallOption, grpc.TrailerCallOption, grpc.PeerCallOption:
		default:
			kept = append(kept, o)
		}
	}
	return kept, w
}
