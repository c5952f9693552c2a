package policy_test

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

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
       "backoffMultiplier": 1.5, "retryableStatusCodes": ["UNAVAILABLE", 8, "DEADLINE_EXCEEDED"],
       "perAttemptRecvTimeout": "0.25s", "unknownField": true}},
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
			Jitter: policy.FullJitter, RetryableCodes: []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded},
			PerAttemptTimeout: 250 * ms}},
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
		{with("backoffMultiplier", "0.5"), []string{"backoffMultiplier", "0.5"}},
		{with("retryableStatusCodes", "[]"), []string{"retryableStatusCodes is missing or empty"}},
		{with("retryableStatusCodes", `["UNAVAILABLE", "SOMETIMES"]`), []string{"retryableStatusCodes[1]", "SOMETIMES"}},
		{with("retryableStatusCodes", `["OK"]`), []string{"retryableStatusCodes[0]", "OK"}},
		{with("retryableStatusCodes", `[99]`), []string{"retryableStatusCodes[0]", "99"}},
		{with("perAttemptRecvTimeout", `"0s"`), []string{"methodConfig[0].retryPolicy.perAttemptRecvTimeout", `"0s"`, "positive"}},
		{with("perAttemptRecvTimeout", `"-1s"`), []string{"methodConfig[0].retryPolicy.perAttemptRecvTimeout", `"-1s"`}},
		{with("perAttemptRecvTimeout", `"250ms"`), []string{"methodConfig[0].retryPolicy.perAttemptRecvTimeout", `"250ms"`}},
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

// withTimeout and withBackoff put a JSON value where a duration goes.
func withTimeout(v string) string {
	return `{"methodConfig": [{"name": [{"service": "s.S"}], "timeout": ` + v + `}]}`
}

func withBackoff(v string) string {
	return `{"methodConfig": [{"name": [{"service": "s.S"}], "retryPolicy": {"maxAttempts": 3, "initialBackoff": ` + v +
		`, "maxBackoff": "315576000000s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
}

func withCode(v string) string {
	return `{"methodConfig": [{"name": [{"service": "s.S"}], "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s",` +
		` "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [` + v + `]}}]}`
}

func TestParseServiceConfigDurations(t *testing.T) {
	tests := []struct {
		value string
		want  time.Duration
	}{
		{`"0.1s"`, 100 * ms},
		{`"1.5s"`, 1500 * ms},
		{`"10s"`, 10 * time.Second},
		{`".01s"`, 10 * ms}, // grpc-go's own retry tests write this
		{`"1.s"`, time.Second},
		{`"+2s"`, 2 * time.Second},
		{`"0.000000001s"`, time.Nanosecond},
		{`"3.000000000s"`, 3 * time.Second},
		{`"\u0031s"`, time.Second}, // a JSON escape of "1s"
	}
	for _, tt := range tests {
		t.Run(tt.value, func(t *testing.T) {
			sc, err := policy.ParseServiceConfig([]byte(withTimeout(tt.value)))
			if err != nil {
				t.Fatalf("timeout %s: %v", tt.value, err)
			}
			if got := sc.Services["s.S"].Timeout; got != tt.want {
				t.Errorf("timeout %s = %v, want %v", tt.value, got, tt.want)
			}
			sc, err = policy.ParseServiceConfig([]byte(withBackoff(tt.value)))
			if err != nil {
				t.Fatalf("initialBackoff %s: %v", tt.value, err)
			}
			if got := sc.Services["s.S"].InitialBackoff; got != tt.want {
				t.Errorf("initialBackoff %s = %v, want %v", tt.value, got, tt.want)
			}
		})
	}
}

func TestParseServiceConfigDurationErrors(t *testing.T) {
	for _, value := range []string{
		`"-1s"`, `"-0.1s"`, // negative
		`"1"`, `"100ms"`, `"1m"`, // no "s" suffix, or another unit
		`"soon"`, `"s"`, `".s"`, `"1e3s"`, `" 1s"`, `"1 s"`, `"1_0s"`, `"01s"`, `"--1s"`, // garbage
		`"0.0000000001s"`, // finer than a nanosecond
		`"315576000001s"`, // beyond google.protobuf.Duration's range
		`1`, `true`, `{}`, // not a string
	} {
		t.Run(value, func(t *testing.T) {
			_, err := policy.ParseServiceConfig([]byte(withTimeout(value)))
			if want := "methodConfig[0].timeout = " + value; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("timeout %s: err = %v, want one containing %q", value, err, want)
			}
			_, err = policy.ParseServiceConfig([]byte(withBackoff(value)))
			if want := "methodConfig[0].retryPolicy.initialBackoff = " + value; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("initialBackoff %s: err = %v, want one containing %q", value, err, want)
			}
		})
	}
}

func TestParseServiceConfigCodes(t *testing.T) {
	tests := []struct {
		value string
		want  codes.Code
	}{
		{`"UNAVAILABLE"`, codes.Unavailable},
		{`"DEADLINE_EXCEEDED"`, codes.DeadlineExceeded},
		{`"UNAUTHENTICATED"`, codes.Unauthenticated},
		{`"UNKNOWN"`, codes.Unknown},
		{`14`, codes.Unavailable},
		{`2`, codes.Unknown},
		{`16`, codes.Unauthenticated},
	}
	for _, tt := range tests {
		sc, err := policy.ParseServiceConfig([]byte(withCode(tt.value)))
		if err != nil {
			t.Errorf("retryableStatusCodes [%s]: %v", tt.value, err)
			continue
		}
		if got := sc.Services["s.S"].RetryableCodes; !slices.Equal(got, []codes.Code{tt.want}) {
			t.Errorf("retryableStatusCodes [%s] = %v, want [%v]", tt.value, got, tt.want)
		}
	}
}

func TestParseServiceConfigCodeErrors(t *testing.T) {
	tests := []struct {
		value string
		why   string // must also appear in the error
	}{
		{`"unavailable"`, "upper-case"}, // gRPC refuses lower case too
		{`"Unavailable"`, "upper-case"},
		{`"CANCELED"`, "upper-case"}, // gRPC spells it CANCELLED
		{`"SOMETIMES"`, "upper-case"},
		{`"14"`, "upper-case"}, // a number, but quoted
		{`14.0`, "upper-case"},
		{`-1`, "upper-case"},
		{`17`, "upper-case"},
		{`true`, "upper-case"},
		{`null`, "upper-case"},
		{`"OK"`, "OK is not a failure to retry"},
		{`0`, "OK is not a failure to retry"},
		{`"CANCELLED"`, "CANCELLED is not a failure to retry"},
		{`1`, "CANCELLED is not a failure to retry"},
	}
	for _, tt := range tests {
		_, err := policy.ParseServiceConfig([]byte(withCode(`"UNAVAILABLE", ` + tt.value)))
		for _, want := range []string{"methodConfig[0].retryPolicy.retryableStatusCodes[1] = " + tt.value, tt.why} {
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("retryableStatusCodes [\"UNAVAILABLE\", %s]: err = %v, want one containing %q", tt.value, err, want)
			}
		}
	}
}

// TestParseServiceConfigFieldNamesAnyCase: gRPC reads its service config
// with encoding/json, which matches field names in any case; so does
// herdguard.
func TestParseServiceConfigFieldNamesAnyCase(t *testing.T) {
	const sc = `{"MethodConfig": [{"Name": [{"Service": "s.S", "METHOD": "M"}], "Timeout": "2s",
	  "RetryPolicy": {"MaxAttempts": 4, "InitialBackoff": "0.5s", "MaxBackoff": "3s", "BackoffMultiplier": 3,
	    "RetryableStatusCodes": ["INTERNAL"]}}],
	 "RetryThrottling": {"MaxTokens": 10, "TokenRatio": 0.5}}`
	got, err := policy.ParseServiceConfig([]byte(sc))
	if err != nil {
		t.Fatal(err)
	}
	want := policy.Policy{MaxAttempts: 4, InitialBackoff: 500 * ms, MaxBackoff: 3 * time.Second, Multiplier: 3,
		RetryableCodes: []codes.Code{codes.Internal}, Timeout: 2 * time.Second}
	if p, ok := got.PolicyFor("/s.S/M"); !ok || !equalPolicy(p, want) {
		t.Errorf("PolicyFor(/s.S/M) = %+v, %v; want %+v", p, ok, want)
	}
	if got.Throttling == nil || *got.Throttling != (policy.Throttling{MaxTokens: 10, TokenRatio: 0.5}) {
		t.Errorf("throttling %+v, want 10 tokens, ratio 0.5", got.Throttling)
	}
}

// TestParseServiceConfigAsGRPCReadsIt gives the same values to gRPC's own
// service config parser (through grpc.WithDefaultServiceConfig, which makes
// NewClient fail on an invalid config; no connection is made) and to
// ParseServiceConfig: they must agree, but for the differences that
// ParseServiceConfig documents.
func TestParseServiceConfigAsGRPCReadsIt(t *testing.T) {
	grpcAccepts := func(sc string) bool {
		cc, err := grpc.NewClient("passthrough:///unused", grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultServiceConfig(sc))
		if err == nil {
			cc.Close()
		}
		return err == nil
	}
	// herdguard refuses these where gRPC accepts them, on purpose.
	differs := map[string]bool{
		withTimeout(`"-1s"`): true, withTimeout(`"-0.1s"`): true, // a negative timeout
		withTimeout(`"0s"`):  true,                             // a zero one: an immediate deadline in gRPC
		withTimeout(`"01s"`): true, withBackoff(`"01s"`): true, // not protobuf's JSON mapping
		withTimeout(`"--1s"`): true, withBackoff(`"--1s"`): true,
		withCode(`"OK"`): true, withCode(`0`): true, withCode(`null`): true, // not failures to retry
		withCode(`"CANCELLED"`): true, withCode(`1`): true,
	}
	var configs []string
	for _, d := range []string{`"0.1s"`, `"1.5s"`, `"10s"`, `".01s"`, `"1.s"`, `"+2s"`, `"0s"`, `"-1s"`, `"-0.1s"`, `"1"`, `"100ms"`,
		`"soon"`, `"s"`, `".s"`, `"1e3s"`, `"01s"`, `"--1s"`, `"0.0000000001s"`, `"315576000001s"`, `1`} {
		configs = append(configs, withTimeout(d), withBackoff(d))
	}
	for _, c := range []string{`"UNAVAILABLE"`, `14`, `16`, `"unavailable"`, `"Unavailable"`, `"14"`, `14.0`, `-1`, `17`, `null`,
		`"OK"`, `0`, `"CANCELLED"`, `"CANCELED"`, `1`} {
		configs = append(configs, withCode(c))
	}
	for _, sc := range configs {
		_, err := policy.ParseServiceConfig([]byte(sc))
		g, h := grpcAccepts(sc), err == nil
		if differs[sc] {
			if !g || h {
				t.Errorf("%s: gRPC accepts %v, herdguard %v (%v); want a documented difference: gRPC true, herdguard false", sc, g, h, err)
			}
			continue
		}
		if g != h {
			t.Errorf("%s: gRPC accepts %v, herdguard %v (%v); want them to agree", sc, g, h, err)
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

// TestParseServiceConfigZeroTimeout: gRPC takes a zero timeout as a deadline
// that has passed already; herdguard's zero Timeout would mean none, so the
// config is refused rather than read as the opposite of what it says.
func TestParseServiceConfigZeroTimeout(t *testing.T) {
	for _, v := range []string{`"0s"`, `"0.0s"`, `"-0s"`} {
		_, err := policy.ParseServiceConfig([]byte(withTimeout(v)))
		if want := "methodConfig[0].timeout = " + v + ": must be positive"; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("timeout %s: err = %v, want one containing %q", v, err, want)
		}
	}
}

// grpcAccepts reports grpc-go's own verdict on js as a default service
// config: the control for what ParseServiceConfig must accept.
func grpcAccepts(t *testing.T, js string) error {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///x", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(js))
	if err != nil {
		return err
	}
	return cc.Close()
}

// Configs gRPC accepts are accepted, and read as gRPC reads them.
func TestParseServiceConfigAcceptsWhatGRPCAccepts(t *testing.T) {
	retry := func(fields string) string {
		return `{"name": [{"service": "a.B"}], "retryPolicy": {"initialBackoff": "0.1s", "maxBackoff": "1s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"], ` + fields + `}}`
	}
	tests := []struct {
		name  string
		json  string
		check func(*policy.ServiceConfig) string
	}{
		{"a method config without a name is skipped unread",
			`{"methodConfig": [{"retryPolicy": {"maxAttempts": 1}}, ` + retry(`"maxAttempts": 3`) + `]}`,
			func(sc *policy.ServiceConfig) string {
				if p, ok := sc.PolicyFor("/a.B/C"); !ok || p.MaxAttempts != 3 || sc.Default != nil {
					return fmt.Sprintf("a.B: %+v, %v; default %v; want 3 attempts, no default", p, ok, sc.Default)
				}
				return ""
			}},
		{"maxAttempts above 2³¹−1",
			`{"methodConfig": [` + retry(`"maxAttempts": 3000000000`) + `]}`,
			func(sc *policy.ServiceConfig) string {
				if p, _ := sc.PolicyFor("/a.B/C"); p.MaxAttempts != math.MaxInt32 {
					return fmt.Sprintf("MaxAttempts = %d, want %d", p.MaxAttempts, math.MaxInt32)
				}
				return ""
			}},
		{"maxBackoff below initialBackoff caps every wait",
			`{"methodConfig": [{"name": [{"service": "a.B"}], "retryPolicy": {"maxAttempts": 3, "initialBackoff": "2s",
				"maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`,
			func(sc *policy.ServiceConfig) string {
				p, _ := sc.PolicyFor("/a.B/C")
				for retry := 1; retry <= 3; retry++ {
					if w := p.RawBackoff(retry); w != time.Second {
						return fmt.Sprintf("wait before retry %d = %v, want maxBackoff's 1s (gRPC: min(2s × 2^n, 1s))", retry, w)
					}
				}
				return ""
			}},
		{"a tokenRatio finer than thousandths",
			`{"methodConfig": [], "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.0004}}`,
			func(sc *policy.ServiceConfig) string {
				if sc.Throttling == nil || sc.Throttling.TokenRatio != 0.0004 {
					return fmt.Sprintf("throttling %+v, want tokenRatio 0.0004", sc.Throttling)
				}
				return ""
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := grpcAccepts(t, tt.json); err != nil {
				t.Fatalf("control: grpc-go refuses %s: %v", tt.json, err)
			}
			sc, err := policy.ParseServiceConfig([]byte(tt.json))
			if err != nil {
				t.Fatalf("ParseServiceConfig refuses what grpc-go accepts: %v", err)
			}
			if msg := tt.check(sc); msg != "" {
				t.Error(msg)
			}
		})
	}
}
