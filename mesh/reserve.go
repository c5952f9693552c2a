package mesh

import (
	"context"
	"slices"
	"time"

	"github.com/herdguard/herdguard"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Option configures the client half.
type Option func(*config)

// config is the client half's configuration; its zero value is the
// defaults.
type config struct {
	reserve    time.Duration // a fixed reserve, when set
	reserveSet bool
	// retries reports whether the connection's herdguard policy retries a
	// code for a method; nil: herdguard's default retryable codes.
	retries func(method string, code codes.Code) bool
	// overloaded reports whether the connection's overload controller
	// paces its calls to a target; nil: it never does.
	overloaded func(target string) bool
}

// withRetries makes the client half ask retries which codes the
// connection's policy retries (DialOptions passes Interceptor.Retries).
func withRetries(retries func(string, codes.Code) bool) Option {
	return func(c *config) { c.retries = retries }
}

// withOverloaded makes the client half ask overloaded whether the
// connection's overload controller paces a target (DialOptions passes
// Interceptor.Overloaded).
func withOverloaded(overloaded func(string) bool) Option {
	return func(c *config) { c.overloaded = overloaded }
}

// overloadedAt reports whether the connection's overload controller paces
// target: evidence that more attempts would hurt it.
func (c config) overloadedAt(target string) bool {
	return c.overloaded != nil && c.overloaded(target)
}

// retriesCode reports whether a call to method that failed with code would
// have been retried below but for a retry above.
func (c config) retriesCode(method string, code codes.Code) bool {
	if c.retries != nil {
		return c.retries(method, code)
	}
	return slices.Contains(herdguard.DefaultRetryableCodes(), code)
}

// Default deadline reserve: a twentieth of the time the request has left,
// at most maxReserve. It has to cover the way back up, one hop's transit
// and its handler's return; more costs the calls below the time they
// could have used to succeed: about the reserve times the request rate,
// per hop, when a line serves its callers at their deadlines, so it is
// kept to a few milliseconds.
const (
	reserveShare = 20
	maxReserve   = 3 * time.Millisecond
)

// WithDeadlineReserve sets the time the client half keeps back from the
// request's deadline for the calls below: they are sent with the request's
// deadline less d, so that a call below that runs out of time ends before
// the request does, and the request still answers its caller in time,
// saying why. d of 0 or less sends them with the request's own deadline,
// as gRPC's propagation alone does. The default keeps back a twentieth of
// the time left, at most 3 ms.
func WithDeadlineReserve(d time.Duration) Option {
	return func(c *config) { c.reserve, c.reserveSet = max(d, 0), true }
}

func newConfig(opts []Option) config {
	var c config
	for _, o := range opts {
		o(&c)
	}
	return c
}

// below returns the context of a call made while serving the request ctx:
// ctx itself, or, when the request has a deadline and the reserve is not
// off, a context that ends the reserve before it (cut is then true, and
// cancel must be called once the call is over).
func (c config) below(ctx context.Context) (callCtx context.Context, cancel context.CancelFunc, cut bool) {
	dl, ok := ctx.Deadline()
	if !ok || c.reserveSet && c.reserve == 0 || grpc.ServerTransportStreamFromContext(ctx) == nil {
		return ctx, func() {}, false
	}
	reserve := c.reserve
	if !c.reserveSet {
		reserve = min(time.Until(dl)/reserveShare, maxReserve)
	}
	if reserve <= 0 {
		return ctx, func() {}, false
	}
	callCtx, cancel = context.WithDeadline(ctx, dl.Add(-reserve))
	return callCtx, cancel, true
}

// outOfTime reports whether a call below, made with callCtx, failed with
// err because the reserve cut its time short: a DeadlineExceeded once its
// own deadline passed, or within a tenth of the reserve of it, while the
// request being served (ctx) is still alive. The margin is for the server
// below, whose copy of the deadline can end a hair before this client's
// timer fires: its DeadlineExceeded is the same running out of time. The
// request then answers in time, and says the call below gave up:
// GaveUpTrailerKey interceptor.OutcomeDeadline.
func outOfTime(ctx, callCtx context.Context, err error) bool {
	if ctx.Err() != nil || status.Code(err) != codes.DeadlineExceeded {
		return false
	}
	if callCtx.Err() == context.DeadlineExceeded {
		return true
	}
	dl, _ := ctx.Deadline()
	callDL, _ := callCtx.Deadline()
	return time.Until(callDL) < dl.Sub(callDL)/10
}
