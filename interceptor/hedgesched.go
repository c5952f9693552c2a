package interceptor

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/clock"
)

// hedger is the one scheduler of gRFC A6 hedging, for a hedged unary call
// (hedgeCall) and a hedged stream (hedging) alike. It owns what A6
// says of hedges: when the next one goes (the hedging delay, latency-aware
// or fixed; at once after a non-fatal failure; after a server's pushback),
// whether it may (the breaker, the overload controller, the throttling and
// the budgets, see hedgeRules), and how a failed attempt is judged
// (non-fatal or not, answered with headers, the client's own error, a
// pushback that stops hedging, throttling's failure count, a layer below
// that gave up). Its caller owns the attempts: how one is started, how a
// winner is committed, and, for a stream, the replay. The caller tells it
// how many attempts it has sent and how many are in flight (hedgeDriver);
// it tells the caller what to do next (hedgeVerdict).
//
// Every method that ends in Locked runs under the caller's lock, which
// guards the hedger's state. The timer's callback is the caller's (fire):
// it takes the caller's lock, and asks timerLocked what to do.
//
// When a pushback delays the next hedge: exactly by its delay, from when
// it came (gRFC A6, "Pushback": the next hedged request "will be issued
// after the given delay has elapsed"; its summary: "Send next hedged
// request in n ms. Subsequent hedged requests will resume at n +
// hedgingDelay"). Until a hedge goes after it, the timer stays set to the
// pushback's end: a timer callback that fired before it came sends
// nothing, and a hedge that was already on its way and only now goes out
// (a stream's hedge that was still opening) sets the timer to the
// pushback's end, not to a hedging delay from now, which could come
// sooner or later. The hedge after the delayed one goes a hedging delay
// after it. A pushback delays only a hedge that may still go: when none
// may follow (out of attempts, or hedging stopped) it has nothing to delay,
// and with no attempt in flight the call ends as exhausted at once. A
// non-fatal failure of another attempt while a pushback waits still sends
// the next hedge at once, as A6 says of non-fatal failures.
type hedger struct {
	hedgeRules
	ic   *Interceptor
	p    *resolved
	call hedgeDriver
	fire func()          // the caller's timer callback
	wg   *sync.WaitGroup // counts the timer's callbacks scheduled or running; nil: not counted

	// Guarded by the caller's lock.
	timer       clock.Timer
	noMore      bool   // no further hedge may go
	stopped     bool   // a pushback said not to hedge again
	refused     string // what refused a hedge: "breaker", "overload", "throttling", "hedge_budget" or "ratio"
	last        error  // the last non-fatal failure
	gaveUpBelow bool   // the latest failure was a layer below's give-up: the call's breaker verdict leaves it out
	// notBefore is when a pushback lets the next hedge go; zero once a
	// hedge went after it.
	notBefore time.Time
}

// hedgeDriver is what a hedger needs to know of the call it schedules.
type hedgeDriver interface {
	// attemptsLocked returns how many attempts the call has sent (or is
	// opening), and how many of those are still in flight.
	attemptsLocked() (sent, inFlight int)
	// names returns the call's method and target, for its metrics.
	names() (method, target string)
}

// hedgeStep is what a hedger tells its caller to do.
type hedgeStep int8

const (
	hedgeWait  hedgeStep = iota // nothing now: an attempt in flight, the timer or a pushback goes on
	hedgeSend                   // send the next hedge now
	hedgeFatal                  // the attempt's failure decides the call: end it with err and outcome
	hedgeOver                   // no attempt is in flight and none may follow: end the call with err and outcome
)

// hedgeVerdict is a hedger's answer: a step, and for hedgeFatal and
// hedgeOver the call's error and outcome.
type hedgeVerdict struct {
	step    hedgeStep
	err     error
	outcome Outcome
}

// startLocked readies h for a call to method under p with rules r. What
// identifies the caller (call, fire, wg) and the timer are kept.
func (h *hedger) startLocked(ic *Interceptor, p *resolved, r hedgeRules) {
	*h = hedger{hedgeRules: r, ic: ic, p: p, call: h.call, fire: h.fire, wg: h.wg, timer: h.timer}
}

// armLocked sets the timer to send the next hedge after d, if another may
// go; while a pushback is waiting, to its end instead.
func (h *hedger) armLocked(d time.Duration) {
	if sent, _ := h.call.attemptsLocked(); h.noMore || sent >= h.max {
		return
	}
	if !h.notBefore.IsZero() {
		d = h.notBefore.Sub(h.ic.clock.Now())
	}
	if h.timer == nil {
		h.addCallback()
		h.timer = h.ic.clock.AfterFunc(d, h.fire)
		return
	}
	if !h.timer.Reset(d) {
		h.addCallback() // it had fired or stopped: a new callback is scheduled
	}
}

func (h *hedger) addCallback() {
	if h.wg != nil {
		h.wg.Add(1)
	}
}

// stopTimerLocked stops the timer; a callback it will no longer run is
// taken off wg.
func (h *hedger) stopTimerLocked() {
	if h.timer != nil && h.timer.Stop() && h.wg != nil {
		h.wg.Done()
	}
}

// endLocked ends hedging: no hedge follows, and the timer stops.
func (h *hedger) endLocked() {
	h.noMore = true
	h.stopTimerLocked()
}

// answeredLocked records that an attempt answered: it earns hedges.
func (h *hedger) answeredLocked() { h.hedges.Call() }

// timerLocked says what to do when the timer fired. A callback of a timer
// that fired just before a pushback set it again sends nothing: the timer
// runs again when the pushback lets the hedge go.
func (h *hedger) timerLocked(ctx context.Context) hedgeVerdict {
	if !h.notBefore.IsZero() && h.ic.clock.Now().Before(h.notBefore) {
		return h.overLocked(ctx)
	}
	return h.nextLocked(ctx)
}

// nextLocked says whether the next attempt goes now: the first always
// does, a hedge if attempts remain and the rules allow it (it is then
// counted in the budgets); otherwise the call may be over.
func (h *hedger) nextLocked(ctx context.Context) hedgeVerdict {
	sent, _ := h.call.attemptsLocked()
	if h.noMore || sent >= h.max || ctx.Err() != nil {
		return h.stopLocked(ctx)
	}
	if sent > 0 {
		if kind := h.refusal(); kind != "" {
			h.refused = kind
			method, target := h.call.names()
			h.ic.metering.refusal(ctx, method, target, kind)
			return h.stopLocked(ctx)
		}
		h.notBefore = time.Time{} // the pushback's wait, if any, is over
	}
	return hedgeVerdict{step: hedgeSend}
}

// stopLocked stops hedging: the call is over once no attempt is in flight.
func (h *hedger) stopLocked(ctx context.Context) hedgeVerdict {
	h.noMore = true
	return h.overLocked(ctx)
}

// overLocked ends a call with no attempt in flight and none to come: by
// its context when that ended, else with the last failure, saying why no
// attempt follows.
func (h *hedger) overLocked(ctx context.Context) hedgeVerdict {
	sent, inFlight := h.call.attemptsLocked()
	if inFlight > 0 || !h.noMore && sent < h.max {
		return hedgeVerdict{}
	}
	if err := ctx.Err(); err != nil {
		return hedgeVerdict{hedgeOver, status.FromContextError(err).Err(), contextOutcome(err)}
	}
	if h.last == nil { // cannot happen: the first attempt always goes
		return hedgeVerdict{hedgeOver, status.Error(codes.Internal, "herdguard: a hedged call sent no attempt"), ""}
	}
	outcome := OutcomeExhausted
	switch {
	case h.stopped:
		outcome = OutcomePushbackStop
	case h.refused != "":
		outcome = OutcomeBudgetExhausted
	}
	return hedgeVerdict{hedgeOver, &RetryError{Attempts: sent, Outcome: outcome, Err: h.last}, outcome}
}

// failedLocked judges an attempt that failed with err, with trailer;
// headers says its server had sent response headers, clientErr that err is
// the client's own. It judges by the rules retries judge by (judge), with
// the policy's non-fatal codes: a fatal failure decides the call (the
// caller's end; headers, which commit the call; the client's own error; a
// code that is not non-fatal); a failure whose trailer says a layer below
// gave up ends the call as a give-up (OutcomePushbackStop), unless its
// code is non-fatal, when hedging stops and the hedges in flight may still
// answer, as after any pushback that says stop. After a non-fatal failure
// the next hedge goes at once, or when the server's pushback says.
// Throttling counts a non-fatal failure and a pushback that says stop, as
// decide does.
func (h *hedger) failedLocked(ctx context.Context, err error, trailer metadata.MD, headers, clientErr bool) hedgeVerdict {
	e := attemptEnd{err: err, trailer: trailer, headers: headers, client: clientErr || clientSide(err)}
	j := judge(ctx, e, h.p.again(err, h.p.nonFatalCode(status.Code(err))))
	if (j.fail == failAgain || j.fail == failStop) && h.throttle != nil {
		h.throttle.Failure()
	}
	if j.fail == failStop {
		h.noMore, h.stopped = true, true
	}
	// The call ends with its latest failure (h.last, or this one if it
	// is fatal), and the breaker judges by it: a hedge still in flight
	// after a give-up below may fail for this target's own reasons.
	h.gaveUpBelow = j.gaveUpBelow
	nonFatal := j.fail == failAgain || j.fail == failStop && j.again
	switch {
	case j.fail == failCaller:
		return hedgeVerdict{hedgeFatal, err, contextOutcome(ctx.Err())}
	case j.gaveUpBelow && !nonFatal: // headers, too, make a failure fatal
		// A layer below gave up, and the failure decides the call: it
		// gives up too, saying so, whatever the code and the headers,
		// as a retried call does (decide).
		sent, _ := h.call.attemptsLocked()
		return hedgeVerdict{hedgeFatal, &RetryError{Attempts: sent, Outcome: OutcomePushbackStop, Err: err}, OutcomePushbackStop}
	case j.fail == failCommitted:
		return hedgeVerdict{hedgeFatal, err, OutcomeFailedAfterCommit}
	case !nonFatal:
		return hedgeVerdict{hedgeFatal, err, OutcomeNotRetryable}
	}
	h.last = err
	if !j.pushback {
		h.stopTimerLocked() // the next hedge goes now; the one after at the delay
		return h.nextLocked(ctx)
	}
	sent, inFlight := h.call.attemptsLocked()
	if h.noMore || sent >= h.max {
		return h.stopLocked(ctx) // no hedge may follow: the pushback has nothing to delay
	}
	if deadline, has := ctx.Deadline(); has && inFlight == 0 && h.ic.clock.Now().Add(j.wait).After(deadline) {
		// no attempt in flight, and the next could not go in time
		return hedgeVerdict{hedgeOver, &RetryError{Attempts: sent, Outcome: OutcomeDeadline, Err: err}, OutcomeDeadline}
	}
	h.notBefore = h.ic.clock.Now().Add(j.wait)
	h.armLocked(j.wait)
	return hedgeVerdict{}
}
