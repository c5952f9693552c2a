package interceptor

import (
	"context"
	"errors"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"

	"github.com/herdguard/herdguard/internal/names"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// Unary returns the unary client interceptor.
//
// An attempt is retried when its code is one of the policy's
// RetryableCodes, or it is a DeadlineExceeded of an attempt run under
// PerAttemptTimeout, and the caller's context is alive, and attempts
// remain, and the server sent no response headers (gRFC A6: headers commit
// the call). Before attempt n+1 the raw wait is
//
//	min(MaxBackoff, InitialBackoff × Multiplier^(n-1))
//
// and the jitter shapes it ([policy.Policy.Backoff]): none (raw), full
// (uniform[0, raw]), equal (raw/2 + uniform[0, raw/2]) or decorrelated
// (min(MaxBackoff, uniform[InitialBackoff, 3 × previous wait])). A server's
// grpc-retry-pushback-ms trailer (gRFC A6) replaces the wait: a
// non-negative number of milliseconds is the wait and restarts the backoff;
// anything else stops the retries. A wait that would end after the
// caller's deadline is not started: the call ends at once with the last
// attempt's status. Every retry carries the metadata herdguard-attempt: N
// (N = 2, 3, ...) and, as gRPC's own retry sends it,
// grpc-previous-rpc-attempts: N-1, so servers can count retries apart.
//
// A call that fails with a code the policy does not retry, that may make a
// single attempt only, that failed after the server sent headers, or that
// the caller cancelled, returns gRPC's error as it is. A call whose retries
// stopped returns a [*RetryError] that carries the last status: out of
// attempts (exhausted), or stopped by a pushback (pushback_stop), on the
// last attempt as on any other. Every attempt catches its response headers
// and trailer, the last too. An answer that says a layer below gave up (a
// stopping pushback with the herdguard-gave-up trailer: package mesh)
// makes a unary call give up with a RetryError (pushback_stop), whatever
// the code, the attempt and the headers, and leaves it out of the
// breaker's and the overload controller's counts: the layer below judged.
// A stream does the same for such an answer that comes before it commits
// (Stream).
//
// A policy whose Hedging is on ([policy.Hedging], or a service config's
// hedgingPolicy) hedges instead of retrying, as gRFC A6 says: the first
// attempt goes at once, the next after the hedging delay while none has
// answered, or at once after a non-fatal failure, or after the server's
// pushback. The first answer (a unary reply, a stream's headers or first
// message) or the first fatal failure decides the call, and every other
// attempt is cancelled; the caller sees that answer only. With a Quantile
// the delay is that quantile of the method's recent attempt latencies,
// never below Delay. A hedge needs the breaker closed with no failure since
// its last success, a throttling token and room in the retry budget when
// those are on, and room in the target's hedge budget ([WithHedgeBudget]),
// which only successful calls earn: under overload hedging stops by itself.
// A half-open probe is never hedged, and the breaker counts a hedged call
// once.
func (ic *Interceptor) Unary() grpc.UnaryClientInterceptor { return ic.unary }

// attemptBuffer holds what an attempt adds to the caller's call options:
// catchers for the response headers (a call whose server sent headers is
// committed, gRFC A6) and for the trailer (where a pushback would be). It is
// pooled so that a call allocates nothing for it.
type attemptBuffer struct {
	// opts is the call's options for its attempts: the caller's, then the
	// catchers. Without options of the caller's it is catch itself; with
	// some, they are copied into copied.
	opts    []grpc.CallOption
	copied  []grpc.CallOption
	catch   [catchers]grpc.CallOption // made with the buffer, for its own header and trailer
	header  metadata.MD
	trailer metadata.MD
	peer    peer.Peer   // set when the attempt reached a server (WithIdempotentOnly); else unused
	timer   clock.Timer // made on the first wait, then reset
	// skipped is the backoff wait a retry skipped to wait in the overload
	// controller's line (see inLine); set whenever it is read.
	skipped decision
}

// copy makes b.opts the caller's opts, then (for a call that is not safe
// to retry) a catcher of the peer, then b.catch. The copies are written one
// by one: calls carry few options (generated code passes one), too few for
// the runtime's bulk copy and clear to pay.
func (b *attemptBuffer) copy(opts []grpc.CallOption, catchPeer bool) {
	n := len(opts)
	if catchPeer {
		n++
	}
	if cap(b.copied) < n+catchers {
		b.copied = make([]grpc.CallOption, n+catchers)
	}
	o := b.copied[: n+catchers : n+catchers] // capped: an interceptor after this one that appends must not write over the catchers
	for i := 0; i < len(opts); i++ {
		o[i] = opts[i]
	}
	if catchPeer {
		o[n-1] = grpc.Peer(&b.peer)
	}
	for i, c := range b.catch {
		o[n+i] = c
	}
	b.opts = o
}

// clearCopied drops what copy copied of the caller's, so that the pooled
// buffer keeps nothing of the call's: n options, and the peer if caught.
// The catchers, which point into b, stay.
func (b *attemptBuffer) clearCopied(n int, peerCaught bool) {
	for i := 0; i < n; i++ {
		b.copied[i] = nil
	}
	if peerCaught {
		b.copied[n] = nil
		b.peer = peer.Peer{}
	}
}

func newAttemptBuffer() any {
	b := new(attemptBuffer)
	b.catch = [catchers]grpc.CallOption{grpc.Header(&b.header), grpc.Trailer(&b.trailer)}
	return b
}

// catchers is how many options at the end of attemptBuffer.opts catch the
// header and the trailer.
const catchers = 2

// unaryCall is one logical unary call: fixed for the call, plus what its
// attempts learn.
type unaryCall struct {
	ic      *Interceptor
	p       *resolved
	tracer  trace.Tracer // nil: tracing off
	method  string
	target  string // cc.Target()
	req     any
	reply   any
	cc      *grpc.ClientConn
	invoker grpc.UnaryInvoker
	buf     *attemptBuffer
	lim     *limits
	ctl     *pacing.Controller // the target's overload controller; nil: off
	unsafe  bool

	attempts int
	outcome  Outcome
	// gaveUpBelow is true when the call ended on a server's "do not retry"
	// that says a layer below gave up (the herdguard-gave-up trailer).
	gaveUpBelow bool
	// notInFlight is true when the call's deadline ran out while no
	// attempt was in flight: during a backoff wait, or before an attempt
	// started.
	notInFlight bool
	// clientErr is true when the call ended with the client's own error.
	clientErr bool
	// hedged is true when the call is hedged; hedges is how many hedges it
	// sent, and winner the number of the attempt that answered (0: none).
	hedged         bool
	hedges, winner int
	breaker        *breaker.Breaker // the call's, nil without one
}

func (ic *Interceptor) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if kept, finish := splitOnFinish(opts); finish != nil {
		err := ic.unary(ctx, method, req, reply, cc, invoker, kept...)
		finished(finish, err)
		return err
	}
	p, noRetry, err := ic.policyFor(method, opts)
	tracer := ic.tracing.tracer()
	var span trace.Span
	if tracer != nil {
		ctx, span = startCall(ctx, tracer, method, targetOf(cc))
	}
	if err != nil {
		msg := err.Error()
		err = status.Error(codes.InvalidArgument, msg)
		if span != nil {
			endCall(span, 0, OutcomeInvalidCallOption, codes.InvalidArgument, msg)
		}
		ic.metering.call(ctx, method, targetOf(cc), OutcomeInvalidCallOption)
		if err != nil && ic.events.on {
			ic.gaveUp(ctx, method, targetOf(cc), OutcomeInvalidCallOption, 0, err)
		}
		return err
	}

	if d := p.p.Timeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	ctx = ic.withIdempotencyKey(ctx)
	unsafe := ic.idempotentOnly && !ic.safeToRetry(method)
	buf := ic.buffers.Get().(*attemptBuffer)
	copied := len(opts) > 0 || unsafe
	if !copied {
		buf.opts = buf.catch[:] // nothing to copy, nor to clear after
	} else {
		buf.copy(opts, unsafe)
	}
	target := targetOf(cc)
	c := unaryCall{ic: ic, p: p, tracer: tracer, method: method, target: target, req: req, reply: reply, cc: cc, invoker: invoker, buf: buf,
		lim: ic.limitsFor(target), ctl: ic.controllerFor(target), unsafe: unsafe}
	maxAttempts := p.p.MaxAttempts
	if p.hedged() {
		maxAttempts = p.p.Hedging.MaxAttempts
		c.hedged = !unsafe && hedgeable(reply) // WithIdempotentOnly: only idempotent methods are hedged
		if !c.hedged {
			maxAttempts = 1 // a hedging policy does not retry
		}
	}
	if noRetry {
		maxAttempts = 1
	}

	if ic.breakers == nil {
		err = c.call(ctx, maxAttempts)
	} else {
		b := ic.breakers.Get(target, method)
		c.breaker = b
		var probe bool
		before, after, berr := b.Execute(func(isProbe bool) herdguard.Verdict {
			probe = isProbe
			if isProbe {
				maxAttempts = 1
			}
			err = c.call(ctx, maxAttempts)
			return ic.verdict(ctx, c.ctl, &callEnd{err: err, clientErr: c.clientErr, outcome: c.outcome, gaveUpBelow: c.gaveUpBelow, notInFlight: c.notInFlight})
		})
		if berr != nil {
			err, c.outcome = berr, refusalOutcome(berr)
		}
		if span != nil {
			var oe *breaker.OpenError
			if errors.As(berr, &oe) {
				breakerRejected(span, oe)
			}
			if before != after {
				breakerChanged(span, b.Scope(), before, after)
			}
			if probe {
				span.SetAttributes(names.AttrBreakerProbe.Bool(true))
			}
		}
	}

	if copied {
		buf.clearCopied(len(opts), unsafe)
	}
	buf.opts, buf.header, buf.trailer = nil, nil, nil
	ic.buffers.Put(buf)
	if span != nil {
		if c.hedged && maxAttempts > 1 {
			span.SetAttributes(names.AttrHedges.Int(c.hedges))
			if c.winner > 0 {
				span.SetAttributes(names.AttrHedgeWinner.Int(c.winner))
			}
		}
		st := status.Convert(err)
		endCall(span, c.attempts, c.outcome, st.Code(), st.Message())
	}
	ic.metering.call(ctx, method, target, c.outcome)
	if err != nil && ic.events.on {
		ic.gaveUp(ctx, method, target, c.outcome, c.attempts, err)
	}
	return err
}

// call makes the call: hedged, or retried (a hedged call allowed a single
// attempt is simply that attempt).
func (c *unaryCall) call(ctx context.Context, maxAttempts int) error {
	if c.hedged && maxAttempts > 1 {
		var t ticket
		if err := c.ic.take(ctx, c.tracer, c.ctl, c.method, c.target, 1, pacing.Fresh, &t); err != nil {
			return c.notSent(ctx, 1, nil, err)
		}
		return c.hedge(ctx, maxAttempts, &t)
	}
	return c.run(ctx, maxAttempts)
}

// callEnd is how a call ended, as its breaker's verdict needs it.
type callEnd struct {
	err         error
	clientErr   bool    // err is the client's own
	outcome     Outcome // the call's outcome
	gaveUpBelow bool    // it gave up because a layer below gave up
	// notInFlight: no attempt was in flight when its deadline ran out.
	notInFlight bool
}

// verdict is what a finished call tells the breaker, for unary calls and
// streams alike. The client's own error, a call the overload controller
// shed and a layer below's give-up say nothing of the server. The caller's
// own cancellation says nothing either, nor does a deadline that ran
// out while no attempt was in flight (notInFlight); a deadline that ran out while
// an attempt was in flight says the server did not answer in time, and the
// breaker's Verdict (by default herdguard.BreakerVerdict's table) judges the
// call's error as it judges any other. A call that failed while the
// target's overload controller (ctl, nil: none) paces says nothing either:
// a server that refuses for load, or refuses everything, is the
// controller's to judge (it holds attempts back, probes, and fails calls at
// once with ErrDown once the server is down); a breaker that opened on the
// same refusals would hold the callers off through the recovery the
// controller's probes find. A server whose process is gone refuses
// nothing: its attempts never reach it, the controller hears nothing, and
// the breaker opens on the failed calls. A caller's quota running out (a
// RESOURCE_EXHAUSTED with a google.rpc.QuotaFailure) says nothing of the
// server either.
func (ic *Interceptor) verdict(ctx context.Context, ctl *pacing.Controller, e *callEnd) herdguard.Verdict {
	err := e.err
	if err == nil {
		return herdguard.Success
	}
	if e.clientErr || e.outcome == OutcomeShed || e.gaveUpBelow || paces(ctl) || quotaFailure(err) {
		return herdguard.Ignored
	}
	switch ctx.Err() {
	case nil:
	case context.DeadlineExceeded:
		if e.notInFlight {
			return herdguard.Ignored
		}
	default:
		return herdguard.Ignored
	}
	if ic.classify != nil {
		return ic.classify(err)
	}
	return herdguard.BreakerVerdict(status.Code(err))
}

// run makes the call's attempts, waiting between them, and returns the
// call's error. It sets c.attempts, c.outcome and c.notInFlight.
func (c *unaryCall) run(ctx context.Context, maxAttempts int) error {
	var (
		bs      = backoffState{timer: &c.buf.timer, method: c.method, target: c.target, lim: c.lim, unsafe: c.unsafe, ctl: c.ctl}
		numbers retryNumbers
	)
	bs.started()
	var (
		last error // the last attempt's error
		end  attemptEnd
		t    ticket
		back bool // this attempt waits at the back of the controller's line
	)
	for attempt := 1; ; attempt++ {
		if back && !paces(c.ctl) {
			// The overload passed since: the retry waits as the policy
			// says, never not at all.
			back = false
			if err := c.ic.pause(ctx, c.tracer, &bs, attempt, c.buf.skipped); err != nil {
				c.outcome, c.notInFlight = contextOutcome(ctx.Err()), true
				return err
			}
		}
		place := pacing.Fresh
		if back {
			place = pacing.Back
		}
		if err := c.ic.take(ctx, c.tracer, c.ctl, c.method, c.target, attempt, place, &t); err != nil {
			return c.notSent(ctx, attempt, last, err)
		}
		c.attempts = attempt
		actx := ctx
		if attempt > 1 {
			actx = numbers.context(ctx, attempt, maxAttempts)
		}
		c.attempt(actx, attempt, &end)
		c.ic.finish(ctx, c.method, c.target, &t, &end, false, false)
		if !t.live {
			c.notInFlight = true // it never went out
		}
		last = end.err
		if end.err == nil {
			c.outcome = OutcomeOK
			bs.succeeded()
			return nil
		}
		c.clientErr = end.client
		d := c.ic.decide(ctx, c.p, &bs, maxAttempts, end)
		if !d.retry {
			c.outcome, c.gaveUpBelow = d.outcome, d.gaveUpBelow
			return d.err
		}
		if back = inLine(c.ctl, d, end.err); back {
			c.buf.skipped = d
			continue
		}
		if err := c.ic.pause(ctx, c.tracer, &bs, attempt+1, d); err != nil {
			c.outcome, c.notInFlight = contextOutcome(ctx.Err()), true
			return err
		}
	}
}

// notSent ends a call whose attempt n the overload controller did not let
// go (err from take): shed, or the context ended while it waited.
func (c *unaryCall) notSent(ctx context.Context, n int, last, err error) error {
	if errors.Is(err, pacing.ErrShed) {
		c.outcome = OutcomeShed
		return shedError(n, last, err)
	}
	c.outcome, c.notInFlight = contextOutcome(ctx.Err()), true
	return err
}

// attempt sends attempt n and says in *end how it ended. An attempt under
// a PerAttemptTimeout has timedOut set on any DeadlineExceeded: gRPC sends
// that deadline to the server too, and the server's copy, rounded down on
// the wire, can end the attempt first.
//
// Every attempt catches its header and trailer, the last too: a failure
// after headers was not retried, gRPC counts a refused pushback for
// throttling, and a trailer that says a layer below gave up (a server
// half's "don't retry") makes the call give up saying so, out of its
// breaker's and its overload controller's counts, whichever attempt it
// comes to.
func (c *unaryCall) attempt(ctx context.Context, n int, end *attemptEnd) {
	*end = attemptEnd{n: n}
	if d := c.p.p.PerAttemptTimeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
		end.timedOut = true
	}
	var span trace.Span
	if c.tracer != nil {
		ctx, span = startAttempt(ctx, c.tracer, c.method, n)
	}
	c.buf.header, c.buf.trailer = nil, nil
	end.err = c.invoker(ctx, c.method, c.req, c.reply, c.cc, c.buf.opts...)
	end.span = span
	end.trailer = c.buf.trailer // an answer's too: it may say a layer below held it back
	if end.err != nil {
		end.timedOut = end.timedOut && status.Code(end.err) == codes.DeadlineExceeded
		end.headers = c.buf.header != nil
		end.reached = !c.unsafe || c.buf.peer.Addr != nil
		end.client = clientSide(end.err)
	}
}
