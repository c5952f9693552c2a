package interceptor

import (
	"strings"
	"sync"
	"sync/atomic"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/budget"
	"github.com/herdguard/herdguard/internal/cow"
	"github.com/herdguard/herdguard/internal/latency"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

// Interceptor retries failed gRPC calls under a policy, inside a circuit
// breaker, and traces every call, attempt and wait. Make one with [New] and
// install it with [Interceptor.DialOptions]. It is safe for concurrent use,
// and its breakers are shared by every connection it is installed on.
type Interceptor struct {
	policy   *resolved
	methods  map[string]*resolved          // exact "/pkg.Svc/Method"
	services map[string]*resolved          // "/pkg.Svc/"
	breakers *breaker.Group                // nil without a breaker
	classify func(error) herdguard.Verdict // the breaker's Verdict; nil: the table
	tracing  tracing
	events   events // the hooks and the logger
	clock    clock.Clock
	rand     func() float64
	buffers  sync.Pool // *attemptBuffer

	streamBuffer int

	metering   metering
	throttling *policy.Throttling // nil: off
	budget     *policy.Budget     // nil: off
	limits     cow.Map[string, *limits]
	// overload is the overload controllers' settings (nil: off), and
	// controllers holds each target's.
	overload       *overload.Settings
	pacingEnv      pacing.Env // the overload controllers' clock and random source
	controllers    cow.Map[string, *targetController]
	lastController atomic.Pointer[targetController]

	idempotencyKey string
	idempotentOnly bool
	idempotent     cow.Map[string, bool] // method -> safe to retry

	// windows holds the recent attempt latencies of each method hedged with
	// a latency-aware delay, and hedgeBudgets the budget of each target's
	// hedges.
	windows       cow.Map[windowKey, *latency.Window]
	hedgeBudgetOf policy.Budget // with its defaults
	hedgeBudgets  cow.Map[string, *budget.Ratio]
	hedgeCalls    sync.Pool // *hedgeCall
}

type windowKey struct {
	method   string
	quantile float64
}

// limits are the retry budgets of one target.
type limits struct {
	throttle *budget.Throttle
	ratio    *budget.Ratio
}

// limitsFor returns the budgets of a target, or nil when none is on.
func (ic *Interceptor) limitsFor(target string) *limits {
	if ic.throttling == nil && ic.budget == nil {
		return nil
	}
	return ic.limits.Get(target, func() *limits {
		var l limits
		if ic.throttling != nil {
			l.throttle, _ = budget.NewThrottle(*ic.throttling) // validated in New
		}
		if ic.budget != nil {
			l.ratio, _ = budget.NewRatio(*ic.budget, ic.clock.Now)
		}
		return &l
	})
}

// resolved is a validated policy with its defaults filled in, ready for the
// hot path.
type resolved struct {
	p         policy.Policy
	retryable uint32 // bit i set: codes.Code(i) is retryable
	nonFatal  uint32 // hedging: bit i set: codes.Code(i) is non-fatal
}

func newResolved(p policy.Policy) *resolved {
	r := &resolved{p: p.WithDefaults()}
	for _, c := range r.p.RetryableCodes {
		r.retryable |= 1 << c
	}
	for _, c := range r.p.Hedging.NonFatalCodes {
		r.nonFatal |= 1 << c
	}
	return r
}

func (r *resolved) retryableCode(c codes.Code) bool { return c < 32 && r.retryable&(1<<c) != 0 }

func (r *resolved) nonFatalCode(c codes.Code) bool { return c < 32 && r.nonFatal&(1<<c) != 0 }

// again reports whether a failed attempt's error err may be tried again
// by its code: the policy's RetryIf first, if it decides, then byCode, the
// codes' answer.
func (r *resolved) again(err error, byCode bool) bool {
	if r.p.RetryIf == nil {
		return byCode
	}
	return r.retryIf(err, byCode)
}

// retryIf is again with the policy's RetryIf set.
func (r *resolved) retryIf(err error, byCode bool) bool {
	if st, ok := status.FromError(err); ok {
		if retry, decided := r.p.RetryIf(st); decided {
			return retry
		}
	}
	return byCode
}

// hedged reports whether calls under r are hedged rather than retried.
func (r *resolved) hedged() bool { return r.p.Hedging.On() }

// window returns the latency window of a method hedged under r with a
// latency-aware delay, or nil.
func (ic *Interceptor) window(r *resolved, method string) *latency.Window {
	q := r.p.Hedging.Quantile
	if q == 0 {
		return nil
	}
	return ic.windows.Get(windowKey{method, q}, func() *latency.Window { return latency.New(q, policy.HedgeSamples) })
}

// hedgeBudget returns the budget of a target's hedges (WithHedgeBudget),
// earned by its calls that succeed.
func (ic *Interceptor) hedgeBudget(target string) *budget.Ratio {
	return ic.hedgeBudgets.Get(target, func() *budget.Ratio {
		r, _ := budget.NewRatio(ic.hedgeBudgetOf, ic.clock.Now) // validated in New
		return r
	})
}

// New returns an interceptor configured by opts. Every option is checked
// here: an unusable value is an error that names the option, the field and
// the value, and nothing is left to fail at call time.
func New(opts ...Option) (*Interceptor, error) {
	c := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&c)
		}
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	ic := &Interceptor{
		policy:       newResolved(c.policy),
		clock:        c.clock,
		rand:         c.rand,
		streamBuffer: c.streamBuffer,
		throttling:   c.throttling,
		budget:       c.budget,

		hedgeBudgetOf: c.hedgeBudget.WithHedgeDefaults(),

		idempotencyKey: c.idempotencyKey,
		events:         newEvents(c.hooks, c.logger),
		idempotentOnly: c.idempotentOnly,
	}
	if c.overload != nil {
		s := *c.overload
		ic.overload = &s
		cl := c.clock // the interceptor's clock and random source, so tests can drive them
		ic.pacingEnv = pacing.Env{Clock: cl, Rand: c.rand}
	}
	ic.tracing.init(c.tp)
	ic.buffers.New = newAttemptBuffer
	ic.hedgeCalls.New = newHedgeCall
	for name, p := range c.methods {
		if strings.HasSuffix(name, "/") {
			if ic.services == nil {
				ic.services = make(map[string]*resolved)
			}
			ic.services[name] = newResolved(p)
		} else {
			if ic.methods == nil {
				ic.methods = make(map[string]*resolved)
			}
			ic.methods[name] = newResolved(p)
		}
	}
	if !c.noBreaker {
		settings := c.breaker
		user := settings.OnStateChange
		settings.OnStateChange = func(scope string, from, to breaker.State, counts breaker.Counts) {
			if user != nil {
				user(scope, from, to, counts)
			}
			ic.metering.transition(scope, from, to)
			ic.events.breakerChanged(BreakerEvent{Scope: scope, From: from, To: to, Counts: counts})
		}
		if settings.Now == nil {
			settings.Now = ic.clock.Now // one clock for the breaker, the retries and the controller
		}
		g, err := breaker.NewGroup(settings)
		if err != nil { // validate has checked; kept so no error is dropped
			return nil, err
		}
		ic.breakers = g
		ic.classify = settings.Verdict
	}
	ic.metering.init(c.mp, ic.breakers, ic.eachController)
	return ic, nil
}

// DialOptions returns the options that install the interceptor on a
// connection: grpc.NewClient(target, ic.DialOptions()...). They chain, so
// interceptors given before them run once per call, and those given after
// them run once per attempt. They also turn off gRPC's own retry
// (grpc.WithDisableRetry), which a service config from
// grpc.WithDefaultServiceConfig, DNS or xDS would otherwise run inside every
// herdguard attempt; gRPC's transparent retry of requests that never
// reached a server stays on. Whoever installs Unary and Stream by hand must
// add grpc.WithDisableRetry() too.
func (ic *Interceptor) DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(ic.Unary()),
		grpc.WithChainStreamInterceptor(ic.Stream()),
		grpc.WithDisableRetry(),
	}
}

// Retries reports whether ic would send another attempt of a call to
// method that failed with code, time and budget allowing: the policy ic
// applies to method (its own, its service's, or the default) allows more
// than one attempt, and code is retryable under it (for a hedged method, a
// non-fatal code). The mesh package's client half asks it of a call that
// a retry above limited to one attempt.
func (ic *Interceptor) Retries(method string, code codes.Code) bool {
	p, _, _ := ic.policyFor(method, nil)
	if p.hedged() {
		return p.nonFatalCode(code)
	}
	return p.p.MaxAttempts > 1 && p.retryableCode(code)
}

// Overloaded reports whether calls to target (a ClientConn's Target())
// are held back for overload: ic's overload controller paces them (the
// server has shown overload), or, in the last second, the server said
// that a layer below it held its answers back in that layer's line (a
// server running the mesh package's server half, whose own calls below
// are paced). It is false without overload control. The mesh package's
// client half asks it before limiting a retry above to one attempt, and
// passes it on to the layer above with each answer.
func (ic *Interceptor) Overloaded(target string) bool {
	ctl := ic.controllerFor(target)
	return paces(ctl) || ctl != nil && ctl.HeldBelow()
}

// Breakers returns the interceptor's circuit breakers, or nil when it has
// none (WithoutBreaker).
func (ic *Interceptor) Breakers() *breaker.Group { return ic.breakers }

// policyFor picks the policy of a call: a CallPolicy or NoRetry option, then
// the method's policy, then its service's, then the default. It allocates
// nothing.
func (ic *Interceptor) policyFor(method string, opts []grpc.CallOption) (p *resolved, noRetry bool, err error) {
	for _, o := range opts {
		switch o := o.(type) {
		case *callPolicyOption:
			p, err = o.p, o.err
		case noRetryOption:
			noRetry = true
		}
	}
	if p != nil || err != nil {
		return p, noRetry, err
	}
	if ic.methods != nil {
		if p, ok := ic.methods[method]; ok {
			return p, noRetry, nil
		}
	}
	if ic.services != nil {
		if i := strings.LastIndexByte(method, '/'); i > 0 {
			if p, ok := ic.services[method[:i+1]]; ok {
				return p, noRetry, nil
			}
		}
	}
	return ic.policy, noRetry, nil
}
