package interceptor

import (
	"context"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/cow"
)

// Names of herdguard's metric instruments.
const (
	MetricAttempts           = "herdguard.client.attempts"
	MetricRetryDelay         = "herdguard.client.retry.delay"
	MetricCalls              = "herdguard.client.calls"
	MetricBreakerState       = "herdguard.client.breaker.state"
	MetricBreakerTransitions = "herdguard.client.breaker.transitions"
	MetricBudgetRefusals     = "herdguard.client.budget.refusals"

	AttrRetry      = attribute.Key("herdguard.retry")
	AttrBudgetKind = attribute.Key("herdguard.budget")
)

// metering finds the instruments for each call. Like tracing, it follows
// the global provider when none is given, and reports metrics off when the
// provider is a no-op, so calls skip all metric work.
type metering struct {
	fixed    bool
	cur      atomic.Pointer[meterSnapshot]
	breakers *breaker.Group // observed by the state gauge; nil without a breaker
}

type meterSnapshot struct {
	mp          metric.MeterProvider
	cmp         bool // mp's type is comparable
	on          bool
	attempts    metric.Int64Counter
	delay       metric.Float64Histogram
	calls       metric.Int64Counter
	transitions metric.Int64Counter
	refusals    metric.Int64Counter
	gauge       metric.Registration

	// measurement options per attribute combination, made once each
	attemptOpts cow.Map[attemptKey, metric.MeasurementOption]
	callOpts    cow.Map[callKey, metric.MeasurementOption]
	delayOpts   cow.Map[string, metric.MeasurementOption]
}

type attemptKey struct {
	method string
	code   codes.Code
	retry  bool
}

type callKey struct {
	method  string
	outcome Outcome
}

func (m *metering) init(mp metric.MeterProvider, breakers *breaker.Group) {
	m.breakers = breakers
	if mp != nil && !isGlobalDelegate(mp) {
		m.fixed = true
	} else {
		mp = otel.GetMeterProvider()
	}
	m.cur.Store(m.newSnapshot(mp))
}

// current returns the instruments as they are, without following a new
// global provider; for callers that hold locks.
func (m *metering) current() *meterSnapshot {
	if s := m.cur.Load(); s.on {
		return s
	}
	return nil
}

// get returns this call's instruments, or nil when metrics are off.
func (m *metering) get() *meterSnapshot {
	s := m.cur.Load()
	if !m.fixed {
		if mp := otel.GetMeterProvider(); !sameProvider(mp, s.mp, s.cmp) {
			next := m.newSnapshot(mp)
			if m.cur.CompareAndSwap(s, next) {
				if s.gauge != nil {
					_ = s.gauge.Unregister()
				}
				s = next
			} else if next.gauge != nil {
				_ = next.gauge.Unregister()
				s = m.cur.Load()
			}
		}
	}
	if !s.on {
		return nil
	}
	return s
}

func isNoopMeter(mp metric.MeterProvider) bool {
	switch mp.(type) {
	case nil, noop.MeterProvider, *noop.MeterProvider:
		return true
	}
	return isGlobalDelegate(mp)
}

func (m *metering) newSnapshot(mp metric.MeterProvider) *meterSnapshot {
	s := &meterSnapshot{mp: mp, cmp: comparable(mp), on: !isNoopMeter(mp)}
	if !s.on {
		return s
	}
	meter := mp.Meter(ScopeName, metric.WithInstrumentationVersion(Version))
	var err error
	report := func(e error) {
		if e != nil && err == nil {
			err = e
		}
	}
	s.attempts, err = meter.Int64Counter(MetricAttempts, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts sent, by method, status code and whether the attempt was a retry."))
	var e error
	s.delay, e = meter.Float64Histogram(MetricRetryDelay, metric.WithUnit("s"),
		metric.WithDescription("Wait before each retry."),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
	report(e)
	s.calls, e = meter.Int64Counter(MetricCalls, metric.WithUnit("{call}"),
		metric.WithDescription("Calls finished, by method and herdguard.outcome."))
	report(e)
	s.transitions, e = meter.Int64Counter(MetricBreakerTransitions, metric.WithUnit("{transition}"),
		metric.WithDescription("Circuit breaker state changes, by scope, from and to."))
	report(e)
	s.refusals, e = meter.Int64Counter(MetricBudgetRefusals, metric.WithUnit("{retry}"),
		metric.WithDescription("Retries the retry budget or throttling refused, by method and budget."))
	report(e)
	gauge, e := meter.Int64ObservableGauge(MetricBreakerState, metric.WithUnit("1"),
		metric.WithDescription("Circuit breaker state per scope: 0 closed, 1 half-open, 2 open."))
	report(e)
	if e == nil && m.breakers != nil {
		g := m.breakers
		s.gauge, e = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
			g.Each(func(b *breaker.Breaker) {
				o.ObserveInt64(gauge, int64(b.LastState()), metric.WithAttributes(AttrBreakerScope.String(b.Scope())))
			})
			return nil
		}, gauge)
		report(e)
	}
	if err != nil {
		otel.Handle(err)
	}
	return s
}

func (s *meterSnapshot) attempt(ctx context.Context, method string, code codes.Code, retry bool) {
	opt := s.attemptOpts.Get(attemptKey{method, code, retry}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)),
			semconv.RPCResponseStatusCode(canonicalCode(code)), AttrRetry.Bool(retry)))
	})
	s.attempts.Add(ctx, 1, opt)
}

func (s *meterSnapshot) call(ctx context.Context, method string, outcome Outcome) {
	opt := s.callOpts.Get(callKey{method, outcome}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)), AttrOutcome.String(string(outcome))))
	})
	s.calls.Add(ctx, 1, opt)
}

func (s *meterSnapshot) retryDelay(ctx context.Context, method string, seconds float64) {
	opt := s.delayOpts.Get(method, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method))))
	})
	s.delay.Record(ctx, seconds, opt)
}

func (s *meterSnapshot) refusal(ctx context.Context, method, kind string) {
	s.refusals.Add(ctx, 1, metric.WithAttributes(semconv.RPCMethod(trimSlash(method)), AttrBudgetKind.String(kind)))
}

func (s *meterSnapshot) transition(scope string, from, to breaker.State) {
	s.transitions.Add(context.Background(), 1, metric.WithAttributes(AttrBreakerScope.String(scope),
		AttrBreakerFrom.String(from.String()), AttrBreakerTo.String(to.String())))
}

func trimSlash(method string) string {
	if len(method) > 0 && method[0] == '/' {
		return method[1:]
	}
	return method
}
