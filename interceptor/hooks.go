package interceptor

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/errs"
)

// Hooks are functions the interceptor calls when something happens to a
// call, each with the call's context and what happened. A nil hook is not
// called and costs nothing. Each runs on the goroutine where the thing
// happened, the call's own (or a hedge's, or a stream's), so it must be
// quick and safe for concurrent use; a hook that panics is recovered, and
// the panic reported to OpenTelemetry's error handler (otel.Handle) and
// to the logger, if any: the call goes on.
type Hooks struct {
	// OnRetry is called when a retry is scheduled: the policy, the budgets
	// and the deadline let attempt e.Attempt+1 go after e.Wait. While the
	// overload controller paces the target, a retry refused for load waits
	// in its line instead of e.Wait (OnHeld tells how long).
	OnRetry func(ctx context.Context, e RetryEvent)
	// OnGiveUp is called once when a call ends with an error, whatever
	// ended it: its Outcome says why.
	OnGiveUp func(ctx context.Context, e GiveUpEvent)
	// OnHeld is called when the overload controller held an attempt back
	// in its line, shed it without sending it, or saw its deadline pass
	// while it waited.
	OnHeld func(ctx context.Context, e HeldEvent)
	// OnBreakerChange is called when a breaker changes state. It runs while
	// the breaker is locked, as breaker.Settings.OnStateChange does: it
	// must return quickly and must not make calls through the interceptor.
	// Its context is context.Background(): a transition belongs to no call.
	OnBreakerChange func(ctx context.Context, e BreakerEvent)
}

// RetryEvent is a retry about to be made (Hooks.OnRetry).
type RetryEvent struct {
	Method string // the full method, "/pkg.Service/Method"
	Target string // the ClientConn's Target()
	// Attempt is the number of the attempt that failed (1 for the first);
	// the retry is attempt Attempt+1.
	Attempt int
	Err     error         // the failed attempt's error
	Wait    time.Duration // the wait before the retry
	// Reason says what set the wait: "backoff" (the policy's), "pushback"
	// (the server's grpc-retry-pushback-ms) or "retry_info" (a
	// google.rpc.RetryInfo in the status).
	Reason string
}

// GiveUpEvent is a call that ended with an error (Hooks.OnGiveUp).
type GiveUpEvent struct {
	Method   string
	Target   string
	Outcome  Outcome // why it ended
	Attempts int     // the attempts it sent (0: none)
	Err      error   // the error the caller gets
}

// HeldEvent is an attempt the overload controller held back or shed
// (Hooks.OnHeld).
type HeldEvent struct {
	Method  string
	Target  string
	Attempt int           // the attempt's number, from 1
	Held    time.Duration // how long it waited in the controller's line
	Shed    bool          // it was shed, not sent
}

// BreakerEvent is a circuit breaker's change of state
// (Hooks.OnBreakerChange).
type BreakerEvent struct {
	Scope    string // the target, or the target and the method
	From, To breaker.State
	// Counts are the calls the transition was judged on (see
	// breaker.Settings.OnStateChange).
	Counts breaker.Counts
}

// WithHooks sets the functions called when a retry is scheduled, a call
// gives up, an attempt is held or shed, or a breaker changes state. A later
// WithHooks replaces an earlier one.
func WithHooks(h Hooks) Option {
	return optionFunc(func(c *config) { c.hooks = h })
}

// WithLogger logs what the hooks see through l: retries and held attempts
// at Debug, a breaker that opens and a call that herdguard gave up on (out
// of attempts, budget or time, shed, refused by an open breaker) at Warn,
// other failed calls and other transitions at Info; with the method, the
// target, the attempt and the status code as attributes. nil, the
// default, logs nothing.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// events dispatches what happens to the hooks and the logger.
type events struct {
	on  bool // a hook or the logger is set: the events are made at all
	h   Hooks
	log *slog.Logger // nil: silent
}

func newEvents(h Hooks, log *slog.Logger) events {
	on := log != nil || h.OnRetry != nil || h.OnGiveUp != nil || h.OnHeld != nil || h.OnBreakerChange != nil
	return events{on: on, h: h, log: log}
}

// gaveUp tells the hooks and the logger (ic.events.on) of a call to target
// that ended with err. Every call that fails is told once, where its
// metric is recorded.
func (ic *Interceptor) gaveUp(ctx context.Context, method, target string, outcome Outcome, attempts int, err error) {
	ic.events.gaveUp(ctx, GiveUpEvent{Method: method, Target: target, Outcome: outcome, Attempts: attempts, Err: err})
}

// retry reports a scheduled retry.
func (ev *events) retry(ctx context.Context, e RetryEvent) {
	if f := ev.h.OnRetry; f != nil {
		ev.safely(ctx, "OnRetry", func() { f(ctx, e) })
	}
	if ev.log != nil && ev.log.Enabled(ctx, slog.LevelDebug) {
		ev.log.LogAttrs(ctx, slog.LevelDebug, "herdguard: retrying", slog.String("rpc.method", e.Method), slog.String("herdguard.target", e.Target),
			slog.Int("herdguard.attempt", e.Attempt), slog.String("rpc.response.status_code", canonicalCode(status.Code(e.Err))),
			slog.Duration("wait", e.Wait), slog.String("reason", e.Reason))
	}
}

// gaveUp reports a call that ended with an error.
func (ev *events) gaveUp(ctx context.Context, e GiveUpEvent) {
	if f := ev.h.OnGiveUp; f != nil {
		ev.safely(ctx, "OnGiveUp", func() { f(ctx, e) })
	}
	if ev.log == nil {
		return
	}
	level := slog.LevelInfo
	switch e.Outcome {
	case OutcomeExhausted, OutcomeBudgetExhausted, OutcomeDeadline, OutcomeShed, OutcomeBreakerOpen, OutcomeBreakerOpenShared, OutcomePushbackStop, OutcomeNotIdempotent:
		level = slog.LevelWarn // herdguard's own decision
	}
	if ev.log.Enabled(ctx, level) {
		ev.log.LogAttrs(ctx, level, "herdguard: call failed", slog.String("rpc.method", e.Method), slog.String("herdguard.target", e.Target),
			slog.String("herdguard.outcome", string(e.Outcome)), slog.Int("herdguard.attempts", e.Attempts),
			slog.String("rpc.response.status_code", canonicalCode(status.Code(e.Err))), slog.String("error", e.Err.Error()))
	}
}

// held reports an attempt held back or shed.
func (ev *events) held(ctx context.Context, e HeldEvent) {
	if f := ev.h.OnHeld; f != nil {
		ev.safely(ctx, "OnHeld", func() { f(ctx, e) })
	}
	if ev.log != nil && ev.log.Enabled(ctx, slog.LevelDebug) {
		ev.log.LogAttrs(ctx, slog.LevelDebug, "herdguard: attempt held back", slog.String("rpc.method", e.Method), slog.String("herdguard.target", e.Target),
			slog.Int("herdguard.attempt", e.Attempt), slog.Duration("held", e.Held), slog.Bool("herdguard.shed", e.Shed))
	}
}

// breakerChanged reports a breaker's transition; it runs while the breaker
// is locked.
func (ev *events) breakerChanged(e BreakerEvent) {
	ctx := context.Background()
	if f := ev.h.OnBreakerChange; f != nil {
		ev.safely(ctx, "OnBreakerChange", func() { f(ctx, e) })
	}
	if ev.log == nil {
		return
	}
	level := slog.LevelInfo
	if e.To == breaker.Open {
		level = slog.LevelWarn
	}
	if ev.log.Enabled(ctx, level) {
		ev.log.LogAttrs(ctx, level, "herdguard: circuit breaker "+e.To.String(), slog.String("herdguard.breaker.scope", e.Scope),
			slog.String("herdguard.breaker.from", e.From.String()), slog.String("herdguard.breaker.to", e.To.String()),
			slog.Uint64("consecutive_failures", uint64(e.Counts.ConsecutiveFailures)), slog.Uint64("failures", uint64(e.Counts.TotalFailures)),
			slog.Uint64("successes", uint64(e.Counts.TotalSuccesses)))
	}
}

// safely calls hook f, named name, and recovers a panic in it: the panic
// is reported, and the call goes on.
func (ev *events) safely(ctx context.Context, name string, f func()) {
	defer func() {
		if r := recover(); r != nil {
			err := errs.Errorf("interceptor: hook %s panicked: %v", name, r)
			otel.Handle(err)
			if ev.log != nil {
				ev.log.LogAttrs(ctx, slog.LevelError, err.Error())
			}
		}
	}()
	f()
}
