package mesh_test

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
)

// TestGaveUp classifies every way a herdguard call ends, wrapped or not:
// the outcomes the end-to-end tests cannot reach on one machine (a fleet's
// shared breaker, a caller's cancellation, whose answer never arrives)
// included.
func TestGaveUp(t *testing.T) {
	last := status.Error(codes.Unavailable, "down")
	re := func(o interceptor.Outcome) error { return &interceptor.RetryError{Attempts: 3, Outcome: o, Err: last} }
	overloaded := &interceptor.RetryError{Attempts: 3, Outcome: interceptor.OutcomeExhausted, Err: last, Overloaded: true}
	tests := []struct {
		err  error
		want interceptor.Outcome // "": not a give-up
	}{
		{re(interceptor.OutcomeExhausted), ""}, // a server failing on its own
		{overloaded, interceptor.OutcomeExhausted},
		{re(interceptor.OutcomeShed), interceptor.OutcomeShed},
		{re(interceptor.OutcomePushbackStop), interceptor.OutcomePushbackStop},
		{re(interceptor.OutcomeBudgetExhausted), interceptor.OutcomeBudgetExhausted},
		{re(interceptor.OutcomeDeadline), ""},
		{&breaker.OpenError{}, interceptor.OutcomeBreakerOpen},
		{&breaker.OpenError{Shared: true}, interceptor.OutcomeBreakerOpenShared},
		{fmt.Errorf("charge: %w", overloaded), interceptor.OutcomeExhausted},
		{last, ""},
		{status.FromContextError(context.Canceled).Err(), ""},
		{nil, ""},
	}
	for _, tt := range tests {
		got, ok := mesh.GaveUp(tt.err)
		if got != tt.want || ok != (tt.want != "") {
			t.Errorf("GaveUp(%v) = %q, %v; want %q, %v", tt.err, got, ok, tt.want, tt.want != "")
		}
	}
}
