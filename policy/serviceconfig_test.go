package policy_test

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/policy"
)

const fullConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "methodConfig": [
    {"name": [{}], "timeout": "30s",
     "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}},
    {"name": [{"service": "shop.v1.Catalog"}],
     "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "2s",
       "backoffMultiplier": 1.5, "retryableStatusCodes": ["UNAVAILABLE", 8, "deadline_exceeded"],
       "unknownField": true}},
    {"name": [{"service": "shop.v1.Payments", "method": "Charge"}, {"service": "shop.v1.Payments", "method": "Refund"}],
     "timeout": "2.5s", "waitForReady": true}
  ],
  "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
}`

func TestParseServiceConfig(t *testing.T) {
	sc, err := policy.ParseServiceConfig([]byte(fullConfig))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		method string
		want   policy.Policy
	}{
		{"/other.Svc/Get", policy.Policy{MaxAttempts: 3, InitialBackoff: 100 * ms, MaxBackoff: time.Second, Multiplier: 2,
			Jitter: policy.FullJitter, RetryableCodes: []codes.Code{codes.Unavailable}, Timeout: 30 * time.Second}},
		{"/shop.v1.Catalog/List", policy.Policy{MaxAttempts: 5, InitialBackoff: 50 * ms, MaxBackoff: 2 * time.Second, Multiplier: 1.5,
			Jitter: policy.FullJitter, RetryableCodes: []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded}}},
		{"shop.v1.Payments/Charge", policy.Policy{MaxAttempts: 1, Timeout: 2500 * ms}},
		{"/shop.v1.Payments/Refund", policy.Policy{MaxAttempts: 1, Timeout: 2500 * ms}},
		// a method of Payments without its own config falls to the default
		{"/shop.v1.Payments/List", policy.Policy{MaxAttempts: 3, InitialBackoff: 100 * ms, MaxBackoff: time.Second, Multiplier: 2,
			Jitter: policy.FullJitter, RetryableCodes: []codes.Code{codes.Unavailable}, Timeout: 30 * time.Second}},
	}
	for _, tt := range tests {
		got, ok := sc.PolicyFor(tt.method)
		if !ok || !equalPolicy(got, tt.want) {
			t.Errorf("PolicyFor(%q) = %+v, %v; want %+v", tt.method, got, ok, tt.want)
		}
	}
	if sc.Throttling == nil || *sc.Throttling != (policy.Throttling{MaxTokens: 10, TokenRatio: 0.1}) {
		t.Errorf("throttling %+v", sc.Throttling)
	}
	empty, err := policy.ParseServiceConfig([]byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := empty.PolicyFor("/a.B/C"); ok || empty.Throttling != nil {
		t.Error("an empty config must give no policy and no throttling")
	}
}

func equalPolicy(a, b policy.Policy) bool {
	return a.MaxAttempts == b.MaxAttempts && a.InitialBackoff == b.InitialBackoff && a.MaxBackoff == b.MaxBackoff &&
		a.Multiplier == b.Multiplier && a.Jitter == b.Jitter && a.PerAttemptTimeout == b.PerAttemptTimeout &&
		a.Timeout == b.Timeout && slices.Equal(a.RetryableCodes, b.RetryableCodes)
}

func TestParseServiceConfigErrors(t *testing.T) {
	rp := func(fields string) string {
		return `{"methodConfig": [{"name": [{"service": "s.S"}], "retryPolicy": {` + fields + `}}]}`
	}
	const ok = `"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]`
	with := func(field, value string) string {
		var m map[string]json.RawMessage
		json.Unmarshal([]byte("{"+ok+"}"), &m)
		if value == "" {
			delete(m, field)
		} else {
			m[field] = json.RawMessage(value)
		}
		b, _ := json.Marshal(m)
		return rp(strings.Trim(string(b), "{}"))
	}
	tests := []struct {
		json string
		want []string
	}{
		{`{"methodConfig": 3}`, []string{"service config"}},
		{`not json`, []string{"service config"}},
		{with("maxAttempts", "1"), []string{"methodConfig[0].retryPolicy.maxAttempts", "= 1"}},
		{with("maxAttempts", "2.5"), []string{"maxAttempts", "2.5"}},
		{with("maxAttempts", ""), []string{"maxAttempts is missing"}},
		{with("initialBackoff", `"100ms"`), []string{"initialBackoff", `"100ms"`}},
		{with("initialBackoff", `"-1s"`), []string{"initialBackoff", `"-1s"`}},
		{with("initialBackoff", `"0s"`), []string{"initialBackoff", `"0s"`}},
		{with("maxBackoff", `"0.05s"`), []string{"maxBackoff", `"0.05s"`, "below initialBackoff"}},
		{with("backoffMultiplier", "0.5"), []string{"backoffMultiplier", "0.5"}},
		{with("retryableStatusCodes", "[]"), []string{"retryableStatusCodes is missing or empty"}},
		{with("retryableStatusCodes", `["UNAVAILABLE", "SOMETIMES"]`), []string{"retryableStatusCodes[1]", "SOMETIMES"}},
		{with("retryableStatusCodes", `["OK"]`), []string{"retryableStatusCodes[0]", "OK"}},
		{with("retryableStatusCodes", `[99]`), []string{"retryableStatusCodes[0]", "99"}},
		{`{"methodConfig": [{"name": [{"service": "s.S"}], "timeout": "soon"}]}`, []string{"methodConfig[0].timeout", `"soon"`}},
		{`{"methodConfig": [{"name": [{"method": "M"}]}]}`, []string{"methodConfig[0].name[0].method", `"M"`}},
		{`{"methodConfig": [{"name": [{"service": "s.S"}]}, {"name": [{"service": "s.S"}]}]}`, []string{"methodConfig[1].name[0]", "methodConfig[0].name[0]"}},
		{`{"retryThrottling": {"maxTokens": 2000, "tokenRatio": 1}}`, []string{"retryThrottling", "MaxTokens = 2000"}},
		{`{"retryThrottling": {"tokenRatio": 1}}`, []string{"retryThrottling.maxTokens is missing"}},
	}
	for _, tt := range tests {
		_, err := policy.ParseServiceConfig([]byte(tt.json))
		if err == nil {
			t.Errorf("ParseServiceConfig(%s) = nil error", tt.json)
			continue
		}
		for _, w := range tt.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("ParseServiceConfig(%s) = %q, want it to contain %q", tt.json, err, w)
			}
		}
	}
}

func FuzzParseServiceConfig(f *testing.F) {
	f.Add([]byte(fullConfig))
	f.Add([]byte(`{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 1e300, "initialBackoff": "1e9s"}}]}`))
	f.Add([]byte(`{"retryThrottling": {"maxTokens": -0, "tokenRatio": 1e-300}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		sc, err := policy.ParseServiceConfig(data)
		if err != nil {
			return
		}
		check := func(p policy.Policy) {
			if err := p.Validate(); err != nil {
				t.Fatalf("a parsed policy does not validate: %v", err)
			}
		}
		if sc.Default != nil {
			check(*sc.Default)
		}
		for _, p := range sc.Services {
			check(p)
		}
		for _, p := range sc.Methods {
			check(p)
		}
	})
}
