package interceptor_test

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
)

// TestRetries: Interceptor.Retries answers from the policy that governs the
// method: its own, its service's, the default, and for a hedged method
// the codes a hedge goes on after; a policy of one attempt retries nothing.
func TestRetries(t *testing.T) {
	aborts := policy.Default()
	aborts.RetryableCodes = []codes.Code{codes.Aborted}
	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, NonFatalCodes: []codes.Code{codes.Internal}}}
	once := policy.Default()
	once.MaxAttempts = 1
	ic, err := interceptor.New(
		interceptor.WithMethodPolicy("/pkg.Svc/Aborts", aborts),
		interceptor.WithMethodPolicy("/pkg.Svc/Once", once),
		interceptor.WithMethodPolicy("/pkg.Hedged/", hedged),
	)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		method string
		code   codes.Code
		want   bool
	}{
		{"/pkg.Svc/Other", codes.Unavailable, true},
		{"/pkg.Svc/Other", codes.ResourceExhausted, true},
		{"/pkg.Svc/Other", codes.Aborted, false},
		{"/pkg.Svc/Other", codes.OK, false},
		{"/pkg.Svc/Aborts", codes.Aborted, true},
		{"/pkg.Svc/Aborts", codes.Unavailable, false},
		{"/pkg.Hedged/Any", codes.Internal, true},
		{"/pkg.Hedged/Any", codes.Unavailable, false},
		{"/pkg.Svc/Other", codes.Code(40), false},
		{"/pkg.Svc/Once", codes.Unavailable, false},
	}
	for _, tt := range tests {
		if got := ic.Retries(tt.method, tt.code); got != tt.want {
			t.Errorf("Retries(%q, %v) = %v, want %v", tt.method, tt.code, got, tt.want)
		}
	}
}
