// Package telemetry names what herdguard records in OpenTelemetry that a
// user queries: its instrumentation scope, its metric instruments and their
// attributes (the dimensions a dashboard groups by), and the spans and span
// attributes a trace search filters on. The tables of every span, event and
// attribute herdguard records are in docs/observability.md.
package telemetry

import "go.opentelemetry.io/otel/attribute"

// The instrumentation scope of herdguard's tracer and meter.
const (
	// ScopeName is the instrumentation scope's name.
	ScopeName = "github.com/herdguard/herdguard/interceptor"
	// Version is herdguard's version, recorded with the scope.
	Version = "0.1.0"
)

// Names of herdguard's metric instruments.
const (
	MetricAttempts           = "herdguard.client.attempts"            // attempts sent, by method, status code, retry and hedge
	MetricRetryDelay         = "herdguard.client.retry.delay"         // backoff waits, in seconds
	MetricCalls              = "herdguard.client.calls"               // calls ended, by method and outcome
	MetricBreakerState       = "herdguard.client.breaker.state"       // each breaker's state (0 closed, 1 half-open, 2 open)
	MetricBreakerTransitions = "herdguard.client.breaker.transitions" // breaker state changes
	MetricBudgetRefusals     = "herdguard.client.budget.refusals"     // retries or hedges a budget refused
	MetricHedges             = "herdguard.client.hedges"              // hedges sent, by whether they won
	MetricOverloadHeld       = "herdguard.client.overload.held"       // how long attempts were held back, in seconds
	MetricOverloadRate       = "herdguard.client.overload.rate"       // the paced rate, attempts per second
	MetricOverloadWaiting    = "herdguard.client.overload.waiting"    // attempts in the line
	MetricOverloadDelayed    = "herdguard.client.overload.delayed"    // attempts sent after waiting
	MetricOverloadShed       = "herdguard.client.overload.shed"       // attempts shed
)

// Attributes of the metrics (beside rpc.method and
// rpc.response.status_code), and of the spans that carry the same facts.
const (
	AttrOutcome       = attribute.Key("herdguard.outcome")        // how a call ended: an interceptor.Outcome
	AttrRetry         = attribute.Key("herdguard.retry")          // the attempt was a retry
	AttrHedge         = attribute.Key("herdguard.hedge")          // the attempt was a hedge
	AttrHedgeWon      = attribute.Key("herdguard.hedge.won")      // the attempt whose answer the caller got
	AttrTarget        = attribute.Key("herdguard.target")         // the ClientConn's Target(): a call's, or the one a controller guards
	AttrBudgetKind    = attribute.Key("herdguard.budget")         // what refused a retry or hedge: "throttling", "ratio", "hedge_budget", ...
	AttrShed          = attribute.Key("herdguard.shed")           // the held attempt was shed, not sent
	AttrBreakerScope  = attribute.Key("herdguard.breaker.scope")  // the breaker's key: a target or a method
	AttrBreakerFrom   = attribute.Key("herdguard.breaker.from")   // the state a breaker left
	AttrBreakerTo     = attribute.Key("herdguard.breaker.to")     // the state a breaker entered
	AttrBreakerShared = attribute.Key("herdguard.breaker.shared") // the fleet's shared breaker, not the replica's own
)

// Spans, and the span attributes a trace search filters on. A call's span
// is gRPC's (otelgrpc's, when installed) or herdguard's own; under it, one
// SpanAttempt per attempt, one SpanBackoff per wait between attempts and
// one SpanHeld per attempt the overload controller held back.
const (
	SpanAttempt = "attempt"
	SpanBackoff = "backoff"
	SpanHeld    = "held"

	AttrAttempts = attribute.Key("herdguard.attempts") // on the call's span: the attempts it made
	AttrAttempt  = attribute.Key("herdguard.attempt")  // on an attempt's span: its number, from 1
)
