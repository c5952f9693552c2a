package interceptor

import (
	"context"

	"github.com/herdguard/herdguard/internal/pacing"

	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/cow"
)

// metering holds the instruments, made once in New from the meter provider
// given, or from the global provider as it is then (which, before an SDK is
// installed, forwards to the first one installed later, as otelgrpc relies
// on). Each measurement first asks its instrument whether it is Enabled, so
// that with no SDK, or a view that drops it, a call does no metric work.
// With a no-op provider there are no instruments at all.
type metering struct {
	attempts    metric.Int64Counter // nil: metrics off
	delay       metric.Float64Histogram
	calls       metric.Int64Counter
	transitions metric.Int64Counter
	refusals    metric.Int64Counter
	hedges      metric.Int64Counter
	heldFor     metric.Float64Histogram

	// measurement options per attribute combination, made once each
	attemptOpts cow.Map[attemptKey, metric.MeasurementOption]
	callOpts    cow.Map[callKey, metric.MeasurementOption]
	delayOpts   cow.Map[methodTarget, metric.MeasurementOption]
	hedgeOpts   cow.Map[hedgeKey, metric.MeasurementOption]
}

// methodTarget is the method and the target (a ClientConn's Target()) of
// a call: every call and attempt metric carries both, so that two backends
// behind one client can be told apart.
type methodTarget struct{ method, target string }

type attemptKey struct {
	methodTarget
	code         codes.Code
	retry, hedge bool
}

type hedgeKey struct {
	methodTarget
	won bool
}

type callKey struct {
	methodTarget
	outcome Outcome
}

func (m *metering) init(mp metric.MeterProvider, breakers *breaker.Group, controllers func(func(string, *pacing.Controller))) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	switch mp.(type) {
	case noop.MeterProvider, *noop.MeterProvider:
		return
	}
	meter := mp.Meter(telemetry.ScopeName, metric.WithInstrumentationVersion(telemetry.Version))
	var err error
	report := func(e error) {
		if e != nil && err == nil {
			err = e
		}
	}
	var e error
	m.attempts, e = meter.Int64Counter(telemetry.MetricAttempts, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts sent, by method, status code and whether the attempt was a retry."))
	report(e)
	m.delay, e = meter.Float64Histogram(telemetry.MetricRetryDelay, metric.WithUnit("s"),
		metric.WithDescription("Wait before each retry."),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
	report(e)
	m.calls, e = meter.Int64Counter(telemetry.MetricCalls, metric.WithUnit("{call}"),
		metric.WithDescription("Calls finished, by method and herdguard.outcome."))
	report(e)
	m.transitions, e = meter.Int64Counter(telemetry.MetricBreakerTransitions, metric.WithUnit("{transition}"),
		metric.WithDescription("Circuit breaker state changes, by scope, from and to."))
	report(e)
	m.refusals, e = meter.Int64Counter(telemetry.MetricBudgetRefusals, metric.WithUnit("{retry}"),
		metric.WithDescription("Retries and hedges the retry budget or throttling refused, by method and budget."))
	report(e)
	m.hedges, e = meter.Int64Counter(telemetry.MetricHedges, metric.WithUnit("{hedge}"),
		metric.WithDescription("Hedges sent (attempts after a hedged call's first), by method and whether the hedge won."))
	report(e)
	gauge, e := meter.Int64ObservableGauge(telemetry.MetricBreakerState, metric.WithUnit("{state}"),
		metric.WithDescription("Circuit breaker state per scope: 0 closed, 1 half-open, 2 open; herdguard.breaker.shared tells the replica's own breaker from the fleet's."))
	report(e)
	if e == nil && breakers != nil {
		_, e = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
			breakers.Each(func(b *breaker.Breaker) {
				o.ObserveInt64(gauge, int64(b.LastState()), metric.WithAttributes(telemetry.AttrBreakerScope.String(b.Scope()), telemetry.AttrBreakerShared.Bool(false)))
				if s, ok := b.FleetState(); ok {
					o.ObserveInt64(gauge, int64(s), metric.WithAttributes(telemetry.AttrBreakerScope.String(b.Scope()), telemetry.AttrBreakerShared.Bool(true)))
				}
			})
			return nil
		}, gauge)
		report(e)
	}
	m.heldFor, e = meter.Float64Histogram(telemetry.MetricOverloadHeld, metric.WithUnit("s"),
		metric.WithDescription("Time attempts were held back by the overload controller, by method and whether the attempt was then shed."),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
	report(e)
	report(m.initOverload(meter, controllers))
	if err != nil {
		otel.Handle(err)
	}
}

// initOverload registers the overload controllers' state: each target's
// rate (0 while calm), its waiting line, and the attempts it delayed and
// shed so far.
func (m *metering) initOverload(meter metric.Meter, controllers func(func(string, *pacing.Controller))) error {
	rate, err := meter.Float64ObservableGauge(telemetry.MetricOverloadRate, metric.WithUnit("{attempt}/s"),
		metric.WithDescription("The overload controller's pace per target while it paces attempts; 0 while the target is calm."))
	if err != nil {
		return err
	}
	waiting, err := meter.Int64ObservableGauge(telemetry.MetricOverloadWaiting, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts waiting in the overload controller's line, per target."))
	if err != nil {
		return err
	}
	delayed, err := meter.Int64ObservableCounter(telemetry.MetricOverloadDelayed, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts the overload controller held back and then sent, per target."))
	if err != nil {
		return err
	}
	shed, err := meter.Int64ObservableCounter(telemetry.MetricOverloadShed, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts the overload controller shed without sending, per target."))
	if err != nil {
		return err
	}
	_, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		controllers(func(target string, c *pacing.Controller) {
			st := c.State()
			attrs := metric.WithAttributes(telemetry.AttrTarget.String(target))
			o.ObserveFloat64(rate, st.Rate, attrs)
			o.ObserveInt64(waiting, int64(st.Waiting), attrs)
			o.ObserveInt64(delayed, int64(st.Delayed), attrs)
			o.ObserveInt64(shed, int64(st.Shed), attrs)
		})
		return nil
	}, rate, waiting, delayed, shed)
	return err
}

// held records the time an attempt was held back, and whether it was shed.
func (m *metering) held(ctx context.Context, method, target string, seconds float64, shed bool) {
	if m.heldFor == nil || !m.heldFor.Enabled(ctx) {
		return
	}
	m.heldFor.Record(ctx, seconds, metric.WithAttributes(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target), telemetry.AttrShed.Bool(shed)))
}

// attempt counts an attempt that ended with err: retry is true for every
// attempt after a call's first, hedge for those that were hedges.
func (m *metering) attempt(ctx context.Context, method, target string, err error, retry, hedge bool) {
	if m.attempts == nil || !m.attempts.Enabled(ctx) {
		return
	}
	code := status.Code(err)
	if !herdguard.IsKnownCode(code) {
		// Any number can come as a status; the attribute names it UNKNOWN,
		// and one key for all keeps the map as small as the attribute's
		// values.
		code = codes.Unknown
	}
	opt := m.attemptOpts.Get(attemptKey{methodTarget{method, target}, code, retry, hedge}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target),
			semconv.RPCResponseStatusCode(canonicalCode(code)), telemetry.AttrRetry.Bool(retry), telemetry.AttrHedge.Bool(hedge)))
	})
	m.attempts.Add(ctx, 1, opt)
}

// hedge counts a hedge that ended, and whether it won.
func (m *metering) hedge(ctx context.Context, method, target string, won bool) {
	if m.hedges == nil || !m.hedges.Enabled(ctx) {
		return
	}
	opt := m.hedgeOpts.Get(hedgeKey{methodTarget{method, target}, won}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target), telemetry.AttrHedgeWon.Bool(won)))
	})
	m.hedges.Add(ctx, 1, opt)
}

func (m *metering) call(ctx context.Context, method, target string, outcome Outcome) {
	if m.calls == nil || !m.calls.Enabled(ctx) {
		return
	}
	opt := m.callOpts.Get(callKey{methodTarget{method, target}, outcome}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target), telemetry.AttrOutcome.String(string(outcome))))
	})
	m.calls.Add(ctx, 1, opt)
}

func (m *metering) retryDelay(ctx context.Context, method, target string, seconds float64) {
	if m.delay == nil || !m.delay.Enabled(ctx) {
		return
	}
	opt := m.delayOpts.Get(methodTarget{method, target}, func() metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target)))
	})
	m.delay.Record(ctx, seconds, opt)
}

func (m *metering) refusal(ctx context.Context, method, target, kind string) {
	if m.refusals == nil || !m.refusals.Enabled(ctx) {
		return
	}
	m.refusals.Add(ctx, 1, metric.WithAttributes(semconv.RPCMethod(trimSlash(method)), telemetry.AttrTarget.String(target), telemetry.AttrBudgetKind.String(kind)))
}

// transition counts a breaker's state change. It runs while the breaker is
// locked.
func (m *metering) transition(scope string, from, to breaker.State) {
	ctx := context.Background()
	if m.transitions == nil || !m.transitions.Enabled(ctx) {
		return
	}
	m.transitions.Add(ctx, 1, metric.WithAttributes(telemetry.AttrBreakerScope.String(scope),
		telemetry.AttrBreakerFrom.String(from.String()), telemetry.AttrBreakerTo.String(to.String())))
}

func trimSlash(method string) string {
	if len(method) > 0 && method[0] == '/' {
		return method[1:]
	}
	return method
}
