package policy_test

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/policy"
)

func TestHedgingValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    policy.Policy
		want string // "" for valid
	}{
		{"off", policy.Policy{}, ""},
		{"on with defaults", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2}}, ""},
		{"latency-aware", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: ms, Quantile: 0.95,
			NonFatalCodes: []codes.Code{codes.Unavailable}}, Timeout: time.Second}, ""},
		{"one attempt", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 1}}, "Hedging.MaxAttempts = 1: must be 0 (off) or at least 2"},
		{"negative attempts", policy.Policy{Hedging: policy.Hedging{MaxAttempts: -2}}, "Hedging.MaxAttempts = -2"},
		{"negative delay", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Delay: -ms}}, "Hedging.Delay = -1ms: must not be negative"},
		{"quantile 1", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Quantile: 1}}, "Hedging.Quantile = 1: must be 0 (a fixed delay) or in (0, 1)"},
		{"quantile NaN", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Quantile: math.NaN()}}, "Hedging.Quantile = NaN"},
		{"non-fatal OK", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, NonFatalCodes: []codes.Code{codes.OK}}}, "Hedging.NonFatalCodes[0] = OK"},
		{"non-fatal unknown", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, NonFatalCodes: []codes.Code{99}}}, "Hedging.NonFatalCodes[0] = 99: not a gRPC status code"},
		{"retried and hedged", policy.Policy{MaxAttempts: 3, Hedging: policy.Hedging{MaxAttempts: 2}}, "MaxAttempts = 3: set beside Hedging"},
		{"retry codes beside hedging", policy.Policy{RetryableCodes: []codes.Code{codes.Internal}, Hedging: policy.Hedging{MaxAttempts: 2}}, "RetryableCodes = [Internal]: set beside Hedging"},
		{"jitter beside hedging", policy.Policy{Jitter: policy.NoJitter, Hedging: policy.Hedging{MaxAttempts: 2}}, "Jitter = none: set beside Hedging"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Validate() = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate() = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestHedgingDefaults(t *testing.T) {
	if h := (policy.Hedging{}).WithDefaults(); h.On() || h.Delay != 0 {
		t.Errorf("the zero Hedging with defaults = %+v, want it off", h)
	}
	codes := []codes.Code{codes.Unavailable}
	h := policy.Hedging{MaxAttempts: 2, NonFatalCodes: codes}.WithDefaults()
	if h.Delay != policy.DefaultHedgeDelay {
		t.Errorf("Delay = %v, want the default %v", h.Delay, policy.DefaultHedgeDelay)
	}
	h.NonFatalCodes[0] = 0
	if codes[0] == 0 {
		t.Error("WithDefaults shares NonFatalCodes with the caller's slice")
	}
}

func TestHedgeDelay(t *testing.T) {
	for _, tc := range []struct {
		name  string
		h     policy.Hedging
		q     time.Duration
		known bool
		want  time.Duration
	}{
		{"fixed", policy.Hedging{MaxAttempts: 2, Delay: 20 * ms}, 50 * ms, true, 20 * ms},
		{"fixed default", policy.Hedging{MaxAttempts: 2}, 0, false, policy.DefaultHedgeDelay},
		{"aware, too few samples", policy.Hedging{MaxAttempts: 2, Delay: 5 * ms, Quantile: 0.95}, 50 * ms, false, 5 * ms},
		{"aware, above the floor", policy.Hedging{MaxAttempts: 2, Delay: 5 * ms, Quantile: 0.95}, 50 * ms, true, 50 * ms},
		{"aware, below the floor", policy.Hedging{MaxAttempts: 2, Delay: 5 * ms, Quantile: 0.95}, 2 * ms, true, 5 * ms},
	} {
		if got := tc.h.HedgeDelay(tc.q, tc.known); got != tc.want {
			t.Errorf("%s: HedgeDelay(%v, %v) = %v, want %v", tc.name, tc.q, tc.known, got, tc.want)
		}
	}
}

func withHedging(v string) string {
	return `{"methodConfig": [{"name": [{"service": "s.S"}], "timeout": "2s", "hedgingPolicy": ` + v + `}]}`
}

func TestParseServiceConfigHedging(t *testing.T) {
	for _, tc := range []struct {
		json string
		want policy.Hedging
	}{
		{`{"maxAttempts": 3, "hedgingDelay": "0.5s", "nonFatalStatusCodes": ["UNAVAILABLE", 8]}`,
			policy.Hedging{MaxAttempts: 3, Delay: 500 * ms, NonFatalCodes: []codes.Code{codes.Unavailable, codes.ResourceExhausted}}},
		// gRFC A6: no hedgingDelay sends every attempt at once
		{`{"maxAttempts": 2}`, policy.Hedging{MaxAttempts: 2, Delay: time.Nanosecond}},
		{`{"maxAttempts": 2, "hedgingDelay": "0s"}`, policy.Hedging{MaxAttempts: 2, Delay: time.Nanosecond}},
		// not capped at 5
		{`{"maxAttempts": 7, "hedgingDelay": "1s"}`, policy.Hedging{MaxAttempts: 7, Delay: time.Second}},
	} {
		sc, err := policy.ParseServiceConfig([]byte(withHedging(tc.json)))
		if err != nil {
			t.Fatalf("%s: %v", tc.json, err)
		}
		p := sc.Services["s.S"]
		h := p.Hedging
		if h.MaxAttempts != tc.want.MaxAttempts || h.Delay != tc.want.Delay || !slices.Equal(h.NonFatalCodes, tc.want.NonFatalCodes) {
			t.Errorf("%s: Hedging = %+v, want %+v", tc.json, h, tc.want)
		}
		if p.Timeout != 2*time.Second || p.MaxAttempts != 0 {
			t.Errorf("%s: Timeout %v, MaxAttempts %d; want the method config's 2s and no retry policy", tc.json, p.Timeout, p.MaxAttempts)
		}
	}
}

func TestParseServiceConfigHedgingErrors(t *testing.T) {
	for _, tc := range []struct {
		json, want string
	}{
		{withHedging(`{"hedgingDelay": "1s"}`), "methodConfig[0].hedgingPolicy.maxAttempts is missing"},
		{withHedging(`{"maxAttempts": 1}`), "methodConfig[0].hedgingPolicy.maxAttempts = 1: must be a whole number of at least 2"},
		{withHedging(`{"maxAttempts": 2.5}`), "methodConfig[0].hedgingPolicy.maxAttempts = 2.5"},
		{withHedging(`{"maxAttempts": 2, "hedgingDelay": "soon"}`), `methodConfig[0].hedgingPolicy.hedgingDelay = "soon"`},
		{withHedging(`{"maxAttempts": 2, "nonFatalStatusCodes": ["OK"]}`), `methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0] = "OK"`},
		{withHedging(`{"maxAttempts": 2, "nonFatalStatusCodes": ["unavailable"]}`), `methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0] = "unavailable"`},
		{`{"methodConfig": [{"name": [{"service": "s.S"}], "hedgingPolicy": {"maxAttempts": 2},
		  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`,
			"methodConfig[0] has both retryPolicy and hedgingPolicy"},
	} {
		_, err := policy.ParseServiceConfig([]byte(tc.json))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want one containing %q", tc.json, err, tc.want)
		}
	}
}

func TestBudgetWithHedgeDefaults(t *testing.T) {
	for _, tc := range []struct{ in, want policy.Budget }{
		{policy.Budget{}, policy.Budget{Ratio: 0.1, MinPerSecond: 1, Window: 10 * time.Second}},
		{policy.Budget{Ratio: 0.02}, policy.Budget{Ratio: 0.02, MinPerSecond: 1, Window: 10 * time.Second}},
		{policy.Budget{MinPerSecond: 5, Window: time.Second}, policy.Budget{Ratio: 0.1, MinPerSecond: 5, Window: time.Second}},
	} {
		if got := tc.in.WithHedgeDefaults(); got != tc.want {
			t.Errorf("%+v.WithHedgeDefaults() = %+v, want %+v", tc.in, got, tc.want)
		}
	}
}
