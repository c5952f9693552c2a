package redisfleet

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// ScopeName is the instrumentation scope of the fleet's metrics.
const ScopeName = "github.com/herdguard/herdguard/redisfleet"

// The fleet's metrics.
const (
	// MetricLost counts the times Redis stopped answering and the
	// replica's own breakers took over.
	MetricLost = "herdguard.breaker.fleet.lost"
	// MetricDropped counts failures and recoveries not delivered to Redis
	// (the queue was full, or Redis did not answer).
	MetricDropped = "herdguard.breaker.fleet.dropped"
	// MetricProbes counts the probe leases this replica was granted.
	MetricProbes = "herdguard.breaker.fleet.probes"
	// MetricReachable is 1 while the fleet follows Redis, 0 while the
	// replica's own breakers decide.
	MetricReachable = "herdguard.breaker.fleet.reachable"
)

type metrics struct {
	lost, dropped, probes metric.Int64Counter
	reg                   metric.Registration // the reachable gauge's callback
}

func (m *metrics) close() error {
	if m.reg == nil {
		return nil
	}
	return m.reg.Unregister()
}

func (m *metrics) init(mp metric.MeterProvider, f *Fleet) {
	meter := mp.Meter(ScopeName)
	var errs []error
	noopMeter := noop.NewMeterProvider().Meter(ScopeName)
	counter := func(name, unit, desc string) metric.Int64Counter {
		c, e := meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		if e != nil {
			errs = append(errs, e)
			c, _ = noopMeter.Int64Counter(name)
		}
		return c
	}
	m.lost = counter(MetricLost, "{loss}", "Times Redis stopped answering and each replica's own breakers took over.")
	m.dropped = counter(MetricDropped, "{report}", "Failures and recoveries not delivered to Redis.")
	m.probes = counter(MetricProbes, "{lease}", "Fleet-wide probe leases granted to this replica.")
	gauge, e := meter.Int64ObservableGauge(MetricReachable, metric.WithUnit("1"),
		metric.WithDescription("1 while the breakers follow the fleet's state in Redis, 0 while each replica's own decide."))
	if e == nil {
		m.reg, e = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
			v := int64(1)
			if f.isLost() {
				v = 0
			}
			o.ObserveInt64(gauge, v)
			return nil
		}, gauge)
	}
	if e != nil {
		errs = append(errs, e)
	}
	for _, err := range errs {
		otel.Handle(err)
	}
}
