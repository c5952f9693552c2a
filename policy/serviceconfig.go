package policy

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard"
)

// ServiceConfig is what herdguard takes from a gRPC service config: the
// retry policy and timeout of each method config, and the retry throttling.
type ServiceConfig struct {
	// Default is the policy of a method config with an empty name; nil if
	// there is none.
	Default *Policy
	// Services maps "pkg.Service" to the policy of its service-wide config.
	Services map[string]Policy
	// Methods maps "pkg.Service/Method" to its own policy.
	Methods map[string]Policy
	// Throttling is the retryThrottling; nil if there is none.
	Throttling *Throttling
}

// PolicyFor returns the policy of a method ("/pkg.Service/Method" or
// "pkg.Service/Method") by gRPC's precedence: the method's own config, then
// its service's, then the default. ok is false when none applies.
func (sc *ServiceConfig) PolicyFor(fullMethod string) (p Policy, ok bool) {
	name := strings.TrimPrefix(fullMethod, "/")
	if p, ok := sc.Methods[name]; ok {
		return p, true
	}
	if svc, _, found := strings.Cut(name, "/"); found {
		if p, ok := sc.Services[svc]; ok {
			return p, true
		}
	}
	if sc.Default != nil {
		return *sc.Default, true
	}
	return Policy{}, false
}

// The JSON shapes of gRPC's service config, as far as herdguard reads it.
// encoding/json matches field names regardless of case and ignores unknown
// fields, as gRPC does.
type serviceConfigJSON struct {
	MethodConfig    []methodConfigJSON `json:"methodConfig"`
	RetryThrottling *struct {
		MaxTokens  *float64 `json:"maxTokens"`
		TokenRatio *float64 `json:"tokenRatio"`
	} `json:"retryThrottling"`
}

type methodConfigJSON struct {
	Name []struct {
		Service string `json:"service"`
		Method  string `json:"method"`
	} `json:"name"`
	Timeout     *string `json:"timeout"`
	RetryPolicy *struct {
		MaxAttempts          *float64          `json:"maxAttempts"`
		InitialBackoff       *string           `json:"initialBackoff"`
		MaxBackoff           *string           `json:"maxBackoff"`
		BackoffMultiplier    *float64          `json:"backoffMultiplier"`
		RetryableStatusCodes []json.RawMessage `json:"retryableStatusCodes"`
	} `json:"retryPolicy"`
}

// ParseServiceConfig reads gRPC's service config JSON: methodConfig with
// names, retryPolicy and timeout, and retryThrottling. Unknown fields are
// ignored, as gRPC ignores them; an invalid value is an error that names its
// JSON path and the value.
//
// Where herdguard differs from gRPC: maxAttempts is not capped at 5;
// backoffMultiplier must be at least 1; maxBackoff must not be below
// initialBackoff; and every imported policy waits with FullJitter, where
// gRPC multiplies each wait by a random factor in [0.8, 1.2]. A method
// config without a retryPolicy makes a single attempt, as in gRPC.
func ParseServiceConfig(data []byte) (*ServiceConfig, error) {
	var raw serviceConfigJSON
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("policy: service config: %w", err)
	}
	sc := &ServiceConfig{Services: map[string]Policy{}, Methods: map[string]Policy{}}
	seen := map[string]string{}
	for i, mc := range raw.MethodConfig {
		at := fmt.Sprintf("methodConfig[%d]", i)
		p, err := mc.policy(at)
		if err != nil {
			return nil, err
		}
		for j, n := range mc.Name {
			where := fmt.Sprintf("%s.name[%d]", at, j)
			key := n.Service + "/" + n.Method
			if prev, dup := seen[key]; dup {
				return nil, fmt.Errorf("policy: service config: %s: {service %q, method %q} is named already at %s", where, n.Service, n.Method, prev)
			}
			seen[key] = where
			switch {
			case n.Service == "" && n.Method != "":
				return nil, fmt.Errorf("policy: service config: %s.method = %q: a method needs its service", where, n.Method)
			case n.Service == "":
				p := p
				sc.Default = &p
			case n.Method == "":
				sc.Services[n.Service] = p
			default:
				sc.Methods[n.Service+"/"+n.Method] = p
			}
		}
	}
	if rt := raw.RetryThrottling; rt != nil {
		switch {
		case rt.MaxTokens == nil:
			return nil, fmt.Errorf("policy: service config: retryThrottling.maxTokens is missing")
		case rt.TokenRatio == nil:
			return nil, fmt.Errorf("policy: service config: retryThrottling.tokenRatio is missing")
		}
		t := Throttling{MaxTokens: *rt.MaxTokens, TokenRatio: *rt.TokenRatio}
		if err := t.Validate(); err != nil {
			return nil, fmt.Errorf("policy: service config: retryThrottling: %w", err)
		}
		sc.Throttling = &t
	}
	return sc, nil
}

func (mc methodConfigJSON) policy(at string) (Policy, error) {
	bad := func(field string, value any, why string) error {
		return fmt.Errorf("policy: service config: %s.%s = %v: %s", at, field, value, why)
	}
	p := Policy{MaxAttempts: 1}
	if mc.Timeout != nil {
		d, err := parseDuration(*mc.Timeout)
		if err != nil {
			return p, bad("timeout", strconv.Quote(*mc.Timeout), err.Error())
		}
		p.Timeout = d
	}
	rp := mc.RetryPolicy
	if rp == nil {
		return p, nil
	}
	at += ".retryPolicy"
	switch {
	case rp.MaxAttempts == nil:
		return p, fmt.Errorf("policy: service config: %s.maxAttempts is missing", at)
	case *rp.MaxAttempts < 2 || *rp.MaxAttempts != math.Trunc(*rp.MaxAttempts) || *rp.MaxAttempts > math.MaxInt32:
		return p, bad("maxAttempts", *rp.MaxAttempts, "must be a whole number of at least 2")
	case rp.InitialBackoff == nil:
		return p, fmt.Errorf("policy: service config: %s.initialBackoff is missing", at)
	case rp.MaxBackoff == nil:
		return p, fmt.Errorf("policy: service config: %s.maxBackoff is missing", at)
	case rp.BackoffMultiplier == nil:
		return p, fmt.Errorf("policy: service config: %s.backoffMultiplier is missing", at)
	case len(rp.RetryableStatusCodes) == 0:
		return p, fmt.Errorf("policy: service config: %s.retryableStatusCodes is missing or empty", at)
	}
	p.MaxAttempts = int(*rp.MaxAttempts)
	var err error
	if p.InitialBackoff, err = parseDuration(*rp.InitialBackoff); err != nil || p.InitialBackoff == 0 {
		return p, bad("initialBackoff", strconv.Quote(*rp.InitialBackoff), "must be a positive duration such as \"0.1s\"")
	}
	if p.MaxBackoff, err = parseDuration(*rp.MaxBackoff); err != nil || p.MaxBackoff == 0 {
		return p, bad("maxBackoff", strconv.Quote(*rp.MaxBackoff), "must be a positive duration such as \"1s\"")
	}
	if p.MaxBackoff < p.InitialBackoff {
		return p, bad("maxBackoff", strconv.Quote(*rp.MaxBackoff), "must not be below initialBackoff")
	}
	p.Multiplier = *rp.BackoffMultiplier
	if !(p.Multiplier >= 1) || math.IsInf(p.Multiplier, 0) {
		return p, bad("backoffMultiplier", p.Multiplier, "must be at least 1 (gRPC allows more than 0; herdguard does not shrink waits)")
	}
	for i, rc := range rp.RetryableStatusCodes {
		c, err := parseCodeJSON(rc)
		if err != nil {
			return p, bad(fmt.Sprintf("retryableStatusCodes[%d]", i), string(rc), err.Error())
		}
		p.RetryableCodes = append(p.RetryableCodes, c)
	}
	p.Jitter = FullJitter
	if err := p.Validate(); err != nil {
		return p, fmt.Errorf("policy: service config: %s: %w", at, err)
	}
	return p, nil
}

// parseDuration reads a protobuf JSON duration: decimal seconds with an "s"
// suffix, such as "0.1s" or "2s".
func parseDuration(s string) (time.Duration, error) {
	num, ok := strings.CutSuffix(s, "s")
	if !ok || num == "" || strings.ContainsAny(num, "eE+ ") {
		return 0, fmt.Errorf(`want seconds with an "s" suffix, such as "0.1s"`)
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f < 0 || f > 315576000000 || math.IsNaN(f) {
		return 0, fmt.Errorf(`want a non-negative number of seconds with an "s" suffix`)
	}
	return time.ParseDuration(s)
}

// parseCodeJSON reads a status code written as a name ("UNAVAILABLE") or a
// number (14). OK and CANCELLED are refused: neither is a failure to retry.
func parseCodeJSON(raw json.RawMessage) (codes.Code, error) {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return 0, err
	}
	var c codes.Code
	switch v := v.(type) {
	case string:
		var ok bool
		if c, ok = herdguard.ParseCode(v); !ok {
			return 0, fmt.Errorf("not a status code name")
		}
	case float64:
		if v != math.Trunc(v) || v < 0 || v > float64(codes.Unauthenticated) {
			return 0, fmt.Errorf("not a status code number")
		}
		c = codes.Code(v)
	default:
		return 0, fmt.Errorf("want a status code name or number")
	}
	if c == codes.OK || c == codes.Canceled {
		return 0, fmt.Errorf("%s is not a failure to retry", herdguard.CodeName(c))
	}
	return c, nil
}
