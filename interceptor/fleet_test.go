package interceptor

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
)

// openFleet is a fleet whose shared breaker is open for an hour: every
// replica refuses. (The fleet over a real Redis is module redisfleet's.)
type openFleet struct{}

func (openFleet) Join(_ string, _ breaker.Settings, v *breaker.FleetView) breaker.FleetMember {
	v.Open(time.Hour)
	return openFleet{}
}
func (openFleet) Failed()    {}
func (openFleet) Recovered() {}
func (openFleet) Probe(context.Context) (breaker.ProbeLease, error) {
	return nil, breaker.ErrProbesTaken
}

// TestSharedRefusalIsToldApart: a call the fleet's shared breaker refused
// says so in its outcome, its span event and the metrics, for a unary call
// and a stream, and the breaker state gauge reports the fleet's state
// beside the replica's own.
func TestSharedRefusalIsToldApart(t *testing.T) {
	rec, tp := newRecorder()
	mrec, mp := newMetrics()
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.OK).unary,
		Bidi: func(testgrpc.TestService_FullDuplexCallServer) error { return nil }})
	ic, err := New(WithTracerProvider(tp), WithMeterProvider(mp), WithBreaker(breaker.Settings{Fleet: openFleet{}}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	err = call(t, c)
	var oe *breaker.OpenError
	if !errors.As(err, &oe) || !oe.Shared || status.Code(err) != codes.Unavailable {
		t.Fatalf("unary call through an open fleet: %v, want the fleet's refusal", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	if st, err := c.FullDuplexCall(ctx); err == nil {
		if _, err = st.Recv(); err == io.EOF {
			t.Fatal("a stream went through an open fleet")
		}
	} else if !errors.As(err, &oe) || !oe.Shared {
		t.Fatalf("stream through an open fleet: %v, want the fleet's refusal", err)
	}
	if got := srv.Requests(); got != 0 {
		t.Errorf("the server got %d requests, want none", got)
	}

	for _, name := range []string{"grpc.testing.TestService/UnaryCall", "grpc.testing.TestService/FullDuplexCall"} {
		cs := spansNamed(rec.Ended(), name)
		if len(cs) != 1 {
			t.Fatalf("%d %s spans", len(cs), name)
		}
		if got := attrs(cs[0])[telemetry.AttrOutcome].AsString(); got != string(OutcomeBreakerOpenShared) {
			t.Errorf("%s outcome %q, want %q", name, got, OutcomeBreakerOpenShared)
		}
		ev := cs[0].Events()
		if len(ev) != 1 || ev[0].Name != names.EventBreakerRejected {
			t.Fatalf("%s events %v", name, ev)
		}
		shared := false
		for _, kv := range ev[0].Attributes {
			if kv.Key == telemetry.AttrBreakerShared {
				shared = kv.Value.AsBool()
			}
		}
		if !shared {
			t.Errorf("%s: the refusal event does not say the breaker is shared", name)
		}
	}
	if got := sumInt(t, mrec, telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrOutcome.String(string(OutcomeBreakerOpenShared))}); got != 2 {
		t.Errorf("%d calls counted as %s, want 2", got, OutcomeBreakerOpenShared)
	}
	gauge, _ := collect(t, mrec, telemetry.MetricBreakerState).(metricdata.Gauge[int64])
	states := map[bool]int64{}
	for _, p := range gauge.DataPoints {
		v, _ := p.Attributes.Value(telemetry.AttrBreakerShared)
		states[v.AsBool()] = p.Value
	}
	if len(gauge.DataPoints) != 2 || states[false] != int64(breaker.Closed) || states[true] != int64(breaker.Open) {
		t.Errorf("breaker state gauge %v, want the replica's own closed and the fleet's open", gauge.DataPoints)
	}
}
