package interceptor

import (
	"log/slog"
	"math/rand/v2"
	"strings"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/errs"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

// Option configures an [Interceptor] in [New].
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// config is what the options build; New validates it.
type config struct {
	policy       policy.Policy
	methods      map[string]policy.Policy // full method or "/pkg.Svc/" -> policy
	methodOrder  []string                 // for errors in the order given
	breaker      breaker.Settings
	noBreaker    bool
	tp           trace.TracerProvider // nil: the global provider
	mp           metric.MeterProvider // nil: the global provider
	clock        clock.Clock
	rand         func() float64
	streamBuffer int
	throttling   *policy.Throttling
	budget       *policy.Budget
	hedgeBudget  policy.Budget
	overload     *overload.Settings // nil: off
	err          error              // the first error an option met while applying

	idempotencyKey string // metadata key; "" = off
	idempotentOnly bool

	hooks  Hooks
	logger *slog.Logger // nil: silent
}

func defaultConfig() config {
	return config{
		policy:       policy.Default(),
		clock:        clock.Real(),
		rand:         rand.Float64,
		streamBuffer: defaultStreamBuffer,
		overload:     &overload.Settings{},
	}
}

// WithOverloadControl sets the overload controller's settings (see package
// overload). It is on by default, with the zero Settings: every attempt to
// a target asks the target's controller first, which lets it go at once
// while the server answers, and paces attempts (first attempts included)
// to what the server takes once it shows overload.
func WithOverloadControl(s overload.Settings) Option {
	return optionFunc(func(c *config) { c.overload = &s })
}

// WithoutOverloadControl turns the overload controller off: attempts go as
// the retry policy, the breaker and the budgets allow, however the server
// fares.
func WithoutOverloadControl() Option {
	return optionFunc(func(c *config) { c.overload = nil })
}

// WithPolicy sets the policy of every call that no method policy or call
// option overrides. Without it, calls use [policy.Default]. Zero fields of p
// mean their defaults: a zero Jitter is full jitter; ask for none with
// policy.NoJitter.
func WithPolicy(p policy.Policy) Option {
	return optionFunc(func(c *config) { c.policy = p })
}

// WithMethodPolicy sets the policy of one method ("/pkg.Service/Method") or
// of every method of a service ("/pkg.Service/"). A method's own policy wins
// over its service's, which wins over WithPolicy. Given twice for the same
// name, the last wins.
func WithMethodPolicy(fullMethod string, p policy.Policy) Option {
	return optionFunc(func(c *config) {
		if c.methods == nil {
			c.methods = make(map[string]policy.Policy)
		}
		if _, dup := c.methods[fullMethod]; !dup {
			c.methodOrder = append(c.methodOrder, fullMethod)
		}
		c.methods[fullMethod] = p
	})
}

// WithBreaker sets the circuit breaker's settings. The breaker is on by
// default with the zero Settings (see package breaker for what they mean).
//
// The breaker wraps the whole retry loop: one call is one result, counted
// once its retries are over, by breaker.Settings.Verdict. By default a
// call's final status says the server is failing (Unavailable,
// DeadlineExceeded, ResourceExhausted, Internal, Unknown, DataLoss) or
// healthy (everything else): the table is [herdguard.BreakerVerdict]. A
// Verdict of one's own replaces it, for example to keep one tenant's
// ResourceExhausted quota from opening the breaker for every tenant:
//
//	interceptor.WithBreaker(breaker.Settings{Verdict: func(err error) herdguard.Verdict {
//		if status.Code(err) == codes.ResourceExhausted {
//			return herdguard.Ignored
//		}
//		return herdguard.BreakerVerdict(status.Code(err))
//	}})
//
// A call the caller cancelled counts for nothing, as does one whose
// deadline ran out during a backoff wait or before its first attempt; a
// deadline that runs out while an attempt is in flight is a failure: the
// server did not answer in time. A stream counts as a success as soon as
// the server answers it (headers or a message), so a long healthy stream
// admitted as a half-open probe closes the breaker at once; a stream that
// fails after that counts for nothing more. An open breaker fails a call at
// once with a [*breaker.OpenError]: errors.Is(err, breaker.ErrOpen) holds
// and status.Code(err) is Unavailable. A call through a half-open breaker
// is a probe and makes a single attempt.
func WithBreaker(s breaker.Settings) Option {
	return optionFunc(func(c *config) { c.breaker, c.noBreaker = s, false })
}

// WithoutBreaker turns the circuit breaker off.
func WithoutBreaker() Option {
	return optionFunc(func(c *config) { c.noBreaker = true })
}

// WithTracerProvider sets where spans go. The default, and a nil tp, is the
// global provider as New finds it: OpenTelemetry's default global provider
// forwards to the first SDK installed, even after New, and until then calls
// do no span work. A provider set globally after another SDK replaced the
// default one is not followed.
//
// Each call has a CLIENT span named after the method ("pkg.Service/Method",
// OpenTelemetry's RPC conventions, semconv v1.43.0) with herdguard.attempts
// and herdguard.outcome (an [Outcome]); its children are a span "attempt"
// per attempt, a span "backoff" per wait and a span "held" per wait in the
// overload controller's line. Breaker refusals and state changes are
// events on the call span. The attempt span's context is what the next
// interceptor and gRPC's stats handlers see, so otelgrpc's spans nest under
// each attempt. The names are constants of package
// github.com/herdguard/herdguard/telemetry; every attribute is in
// docs/observability.md
// (https://github.com/herdguard/herdguard/blob/main/docs/observability.md#spans).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) { c.tp = tp })
}

// WithMeterProvider sets where metrics go. The default, and a nil mp, is the
// global provider as New finds it, which, as OpenTelemetry's default one
// does, forwards to the first SDK installed, even after New. A measurement is
// skipped while its instrument is not Enabled; with a no-op provider no
// metric work is done at all. The instruments are named in package
// github.com/herdguard/herdguard/telemetry (MetricAttempts, MetricCalls,
// MetricRetryDelay, the breaker's, the budgets', the hedges' and the
// overload controller's); their attributes are in docs/observability.md
// (https://github.com/herdguard/herdguard/blob/main/docs/observability.md#metrics).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) { c.mp = mp })
}

// WithStreamBuffer sets how many bytes of encoded messages a stream keeps
// for replay until it commits; 256 KiB without it, as gRPC's own retry keeps. A
// stream whose messages outgrow it commits and is not retried after. 0 makes
// every stream commit at its first message.
func WithStreamBuffer(bytes int) Option {
	return optionFunc(func(c *config) { c.streamBuffer = bytes })
}

// WithRetryThrottling turns on gRPC's retry throttling (gRFC A6) with
// exactly its semantics: a token bucket per target, shared by the unary
// calls and streams of this interceptor. Each attempt that fails with a
// retryable code takes a token, each successful call adds TokenRatio, and
// retries stop while half the tokens or fewer are left. A call whose retry
// is refused ends at once with its last status (outcome budget_exhausted).
func WithRetryThrottling(t policy.Throttling) Option {
	return optionFunc(func(c *config) { c.throttling = &t })
}

// WithRetryBudget turns on a ratio retry budget per target, shared by the
// unary calls and streams of this interceptor: a retry is allowed while the
// retries of the last Window are fewer than Ratio × the calls started in it
// plus MinPerSecond × Window. A call whose retry is refused ends at once with
// its last status (outcome budget_exhausted).
func WithRetryBudget(b policy.Budget) Option {
	return optionFunc(func(c *config) { c.budget = &b })
}

// WithHedgeBudget sets the budget that hedges pass, one per target, shared
// by the hedged unary calls and streams of this interceptor: a hedge is
// sent while the hedges of the last Window are fewer than Ratio × the
// hedged calls to the target that succeeded in it (a stream succeeds when
// the server answers it), plus MinPerSecond × Window. Its zero
// fields mean 0.1, 1 a second and 10s ([policy.Budget.WithHedgeDefaults]).
// Because only answers earn hedges, a server that stops answering stops
// receiving them. The budget is always on for hedged calls; a hedge must
// also pass the retry throttling and the WithRetryBudget budget, if on, and
// the breaker must be closed with no failure since its last success.
func WithHedgeBudget(b policy.Budget) Option {
	return optionFunc(func(c *config) { c.hedgeBudget = b })
}

// WithServiceConfig takes the retry policies, timeouts and retry throttling
// from gRPC service config JSON (see [policy.ParseServiceConfig] for what is
// read and how herdguard differs from gRPC). The default method config acts
// as WithPolicy, service and method configs as WithMethodPolicy, and
// retryThrottling as WithRetryThrottling; options given later override
// them. As in gRPC, once a config names any method config, a method it does
// not cover makes a single attempt: with no default (nameless) method
// config, the config acts as WithPolicy(policy.Policy{MaxAttempts: 1}). A
// config without methodConfig leaves the policies as they were. An invalid
// config makes New fail, naming the JSON path and value.
//
// Give the same config to gRPC too, with grpc.WithDefaultServiceConfig, for
// what herdguard does not read (waitForReady, message size limits, load
// balancing): [Interceptor.DialOptions] turns gRPC's own retry off, so its
// retryPolicy does not run inside herdguard's attempts.
func WithServiceConfig(json string) Option {
	return optionFunc(func(c *config) {
		sc, err := policy.ParseServiceConfig([]byte(json))
		if err != nil {
			if c.err == nil {
				c.err = errs.Errorf("interceptor: WithServiceConfig: %w", err)
			}
			return
		}
		switch {
		case sc.Default != nil:
			WithPolicy(*sc.Default).apply(c)
		case len(sc.Services) > 0 || len(sc.Methods) > 0:
			WithPolicy(policy.Policy{MaxAttempts: 1}).apply(c)
		}
		for svc, p := range sc.Services {
			WithMethodPolicy("/"+svc+"/", p).apply(c)
		}
		for m, p := range sc.Methods {
			WithMethodPolicy("/"+m, p).apply(c)
		}
		if sc.Throttling != nil {
			WithRetryThrottling(*sc.Throttling).apply(c)
		}
	})
}

// WithIdempotencyKey attaches an idempotency key to every logical call and
// stream: outgoing metadata metadataKey with a fresh random value per call,
// the same on each of its attempts, so a server can refuse a duplicate of
// something it already did. metadataKey must be a valid, non-reserved
// metadata key, such as "idempotency-key".
func WithIdempotencyKey(metadataKey string) Option {
	return optionFunc(func(c *config) { c.idempotencyKey = metadataKey })
}

// WithIdempotentOnly retries freely only the methods whose protobuf
// definition says they are safe to repeat (idempotency_level IDEMPOTENT or
// NO_SIDE_EFFECTS, read from the registered descriptors). Any other method,
// or one with no registered descriptor, is retried only when its request
// provably never reached the server: no connection to it could be made.
// Such a call that fails after it may have been acted on ends with outcome
// not_idempotent.
func WithIdempotentOnly() Option {
	return optionFunc(func(c *config) { c.idempotentOnly = true })
}

// withClock replaces the wall clock; tests use it to make waits instant.
func withClock(cl clock.Clock) Option {
	return optionFunc(func(c *config) {
		if cl != nil {
			c.clock = cl
		}
	})
}

// withRand replaces the source of the random numbers in [0, 1) that jitter
// uses; tests use it to make waits exact.
func withRand(r func() float64) Option {
	return optionFunc(func(c *config) {
		if r != nil {
			c.rand = r
		}
	})
}

// validMethodName reports whether name is "/pkg.Service/Method" or
// "/pkg.Service/".
func validMethodName(name string) bool {
	if !strings.HasPrefix(name, "/") {
		return false
	}
	svc, method, ok := strings.Cut(name[1:], "/")
	return ok && svc != "" && !strings.Contains(method, "/") && !strings.ContainsAny(name, " \t\n")
}

func (c *config) validate() error {
	if c.err != nil {
		return c.err
	}
	if err := c.policy.Validate(); err != nil {
		return errs.Errorf("interceptor: WithPolicy: %w", err)
	}
	for _, name := range c.methodOrder {
		if !validMethodName(name) {
			return errs.Errorf(`interceptor: WithMethodPolicy: method name %q must look like "/pkg.Service/Method" or "/pkg.Service/"`, name)
		}
		if err := c.methods[name].Validate(); err != nil {
			return errs.Errorf("interceptor: WithMethodPolicy(%q): %w", name, err)
		}
	}
	if c.throttling != nil {
		if err := c.throttling.Validate(); err != nil {
			return errs.Errorf("interceptor: WithRetryThrottling: %w", err)
		}
	}
	if c.budget != nil {
		if err := c.budget.Validate(); err != nil {
			return errs.Errorf("interceptor: WithRetryBudget: %w", err)
		}
	}
	if err := c.hedgeBudget.Validate(); err != nil {
		return errs.Errorf("interceptor: WithHedgeBudget: %w", err)
	}
	if k := c.idempotencyKey; k != "" && !validMetadataKey(k) {
		return errs.Errorf("interceptor: WithIdempotencyKey(%q): want a lower-case metadata key of letters, digits, '-', '_' and '.', not starting with \"grpc-\" nor ending in \"-bin\"", k)
	}
	if c.streamBuffer < 0 {
		return errs.Errorf("interceptor: WithStreamBuffer(%d): must not be negative", c.streamBuffer)
	}
	if !c.noBreaker {
		if err := c.breaker.Validate(); err != nil {
			return errs.Errorf("interceptor: WithBreaker: %w", err)
		}
	}
	if c.overload != nil {
		if err := c.overload.Validate(); err != nil {
			return errs.Errorf("interceptor: WithOverloadControl: %w", err)
		}
	}
	return nil
}

// validMetadataKey reports whether k can carry a plain string value.
func validMetadataKey(k string) bool {
	if k == "" || strings.HasPrefix(k, "grpc-") || strings.HasSuffix(k, "-bin") {
		return false
	}
	for _, r := range k {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}
