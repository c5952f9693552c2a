package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/errs"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

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
// fields, as gRPC's own parser (which also uses encoding/json) does. Durations
// and status codes stay raw here and are read one by one, so that an error
// can name its JSON path.
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
	Timeout     *json.RawMessage `json:"timeout"`
	RetryPolicy *struct {
		MaxAttempts           *float64          `json:"maxAttempts"`
		InitialBackoff        *json.RawMessage  `json:"initialBackoff"`
		MaxBackoff            *json.RawMessage  `json:"maxBackoff"`
		BackoffMultiplier     *float64          `json:"backoffMultiplier"`
		RetryableStatusCodes  []json.RawMessage `json:"retryableStatusCodes"`
		PerAttemptRecvTimeout *json.RawMessage  `json:"perAttemptRecvTimeout"`
	} `json:"retryPolicy"`
	HedgingPolicy *struct {
		MaxAttempts         *float64          `json:"maxAttempts"`
		HedgingDelay        *json.RawMessage  `json:"hedgingDelay"`
		NonFatalStatusCodes []json.RawMessage `json:"nonFatalStatusCodes"`
	} `json:"hedgingPolicy"`
}

// ParseServiceConfig reads gRPC's service config JSON: methodConfig with
// names, retryPolicy or hedgingPolicy and timeout, and retryThrottling. A
// retryPolicy's perAttemptRecvTimeout, which gRPC's C core honours and
// grpc-go ignores, becomes the policy's PerAttemptTimeout: an attempt
// that waits longer for its answer (for a stream, its response headers)
// fails with DeadlineExceeded and is retried, whatever the retryable
// codes. Unknown fields are
// ignored and field names match in any case, as in gRPC; an invalid value is
// an error that names its JSON path and the value.
//
// Values are read as gRPC reads them: durations as protobuf's JSON mapping
// of google.protobuf.Duration writes them ("0.1s", "1.5s", ".01s"), through
// protojson and durationpb; status codes through codes.Code's UnmarshalJSON,
// as a quoted upper-case name ("UNAVAILABLE") or a number (14), so
// "unavailable" is refused as gRPC refuses it; OK and CANCELLED are refused
// too, as neither is a failure to retry.
//
// As in gRPC, a method config without a name is skipped unread, and a
// maxBackoff below initialBackoff caps every wait (InitialBackoff becomes
// maxBackoff).
//
// Where herdguard differs from gRPC: maxAttempts is not capped at 5 (but at
// 2³¹−1); backoffMultiplier must be at least 1; a negative or zero timeout
// is refused; a duration must follow
// protobuf's JSON mapping, so the forms only gRPC's own lenient reader takes
// ("01s", "--1s") are refused; and every imported policy waits with
// FullJitter, where gRPC multiplies each wait by a random factor in
// [0.8, 1.2]. A method config without a retryPolicy makes a single attempt,
// as in gRPC.
func ParseServiceConfig(data []byte) (*ServiceConfig, error) {
	var raw serviceConfigJSON
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, errs.Errorf("policy: service config: %w", err)
	}
	sc := &ServiceConfig{Services: map[string]Policy{}, Methods: map[string]Policy{}}
	seen := map[string]string{}
	for i, mc := range raw.MethodConfig {
		if mc.Name == nil {
			continue // names no method: gRPC skips it without reading it
		}
		at := fmt.Sprintf("methodConfig[%d]", i)
		p, err := mc.policy(at)
		if err != nil {
			return nil, err
		}
		for j, n := range mc.Name {
			where := fmt.Sprintf("%s.name[%d]", at, j)
			key := n.Service + "/" + n.Method
			if prev, dup := seen[key]; dup {
				return nil, errs.Errorf("policy: service config: %s: {service %q, method %q} is named already at %s", where, n.Service, n.Method, prev)
			}
			seen[key] = where
			switch {
			case n.Service == "" && n.Method != "":
				return nil, errs.Errorf("policy: service config: %s.method = %q: a method needs its service", where, n.Method)
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
			return nil, errs.Errorf("policy: service config: retryThrottling.maxTokens is missing")
		case rt.TokenRatio == nil:
			return nil, errs.Errorf("policy: service config: retryThrottling.tokenRatio is missing")
		}
		t := Throttling{MaxTokens: *rt.MaxTokens, TokenRatio: *rt.TokenRatio}
		if err := t.Validate(); err != nil {
			return nil, errs.Errorf("policy: service config: retryThrottling: %w", err)
		}
		sc.Throttling = &t
	}
	return sc, nil
}

func (mc methodConfigJSON) policy(at string) (Policy, error) {
	bad := func(field string, value any, why string) error {
		return errs.Errorf("policy: service config: %s.%s = %v: %s", at, field, value, why)
	}
	badErr := func(field string, value any, err error) error {
		return errs.Errorf("policy: service config: %s.%s = %v: %w", at, field, value, err)
	}
	p := Policy{MaxAttempts: 1}
	if mc.Timeout != nil {
		d, err := parseDuration(*mc.Timeout)
		if err != nil {
			return p, badErr("timeout", string(*mc.Timeout), err)
		}
		if d == 0 {
			// gRPC would end every call at once; a zero Timeout means none.
			return p, bad("timeout", string(*mc.Timeout), "must be positive (gRPC takes zero as an immediate deadline, herdguard's zero Timeout means no bound)")
		}
		p.Timeout = d
	}
	if mc.RetryPolicy != nil && mc.HedgingPolicy != nil {
		return p, errs.Errorf("policy: service config: %s has both retryPolicy and hedgingPolicy: a method is retried or hedged, never both (gRFC A6)", at)
	}
	if mc.HedgingPolicy != nil {
		return mc.hedging(p, at+".hedgingPolicy")
	}
	rp := mc.RetryPolicy
	if rp == nil {
		return p, nil
	}
	at += ".retryPolicy"
	switch {
	case rp.MaxAttempts == nil:
		return p, errs.Errorf("policy: service config: %s.maxAttempts is missing", at)
	case *rp.MaxAttempts < 2 || *rp.MaxAttempts != math.Trunc(*rp.MaxAttempts):
		return p, bad("maxAttempts", *rp.MaxAttempts, "must be a whole number of at least 2")
	case rp.InitialBackoff == nil:
		return p, errs.Errorf("policy: service config: %s.initialBackoff is missing", at)
	case rp.MaxBackoff == nil:
		return p, errs.Errorf("policy: service config: %s.maxBackoff is missing", at)
	case rp.BackoffMultiplier == nil:
		return p, errs.Errorf("policy: service config: %s.backoffMultiplier is missing", at)
	case len(rp.RetryableStatusCodes) == 0:
		return p, errs.Errorf("policy: service config: %s.retryableStatusCodes is missing or empty", at)
	}
	p.MaxAttempts = maxAttempts(*rp.MaxAttempts)
	var err error
	if p.InitialBackoff, err = parseDuration(*rp.InitialBackoff); err != nil {
		return p, badErr("initialBackoff", string(*rp.InitialBackoff), err)
	}
	if p.InitialBackoff == 0 {
		return p, bad("initialBackoff", string(*rp.InitialBackoff), "must be positive, such as \"0.1s\"")
	}
	if p.MaxBackoff, err = parseDuration(*rp.MaxBackoff); err != nil {
		return p, badErr("maxBackoff", string(*rp.MaxBackoff), err)
	}
	if p.MaxBackoff == 0 {
		return p, bad("maxBackoff", string(*rp.MaxBackoff), "must be positive, such as \"1s\"")
	}
	// Below initialBackoff, gRPC caps every wait at maxBackoff: so does
	// an InitialBackoff of maxBackoff.
	p.InitialBackoff = min(p.InitialBackoff, p.MaxBackoff)
	p.Multiplier = *rp.BackoffMultiplier
	if !(p.Multiplier >= 1) || math.IsInf(p.Multiplier, 0) {
		return p, bad("backoffMultiplier", p.Multiplier, "must be at least 1 (gRPC allows more than 0; herdguard does not shrink waits)")
	}
	for i, rc := range rp.RetryableStatusCodes {
		c, err := parseCode(rc)
		if err != nil {
			return p, badErr(fmt.Sprintf("retryableStatusCodes[%d]", i), string(rc), err)
		}
		p.RetryableCodes = append(p.RetryableCodes, c)
	}
	if rp.PerAttemptRecvTimeout != nil {
		if p.PerAttemptTimeout, err = parseDuration(*rp.PerAttemptRecvTimeout); err != nil {
			return p, badErr("perAttemptRecvTimeout", string(*rp.PerAttemptRecvTimeout), err)
		}
		if p.PerAttemptTimeout == 0 {
			return p, bad("perAttemptRecvTimeout", string(*rp.PerAttemptRecvTimeout), "must be positive, such as \"0.5s\"")
		}
	}
	p.Jitter = FullJitter
	if err := p.Validate(); err != nil {
		return p, errs.Errorf("policy: service config: %s: %w", at, err)
	}
	return p, nil
}

// maxAttempts is a whole number of at least 2 read from JSON as an int:
// gRPC caps it at 5, herdguard does not, but counts more than 2³¹−1
// attempts (which no deadline would let happen) as 2³¹−1.
func maxAttempts(n float64) int {
	return int(min(n, math.MaxInt32))
}

// hedging reads a method config's hedgingPolicy into p, which holds its
// timeout. A missing or zero hedgingDelay, which gRFC A6 reads as sending
// every attempt at once, becomes a Delay of 1ns: a zero Delay is
// herdguard's default.
func (mc methodConfigJSON) hedging(p Policy, at string) (Policy, error) {
	bad := func(field string, value any, why string) error {
		return errs.Errorf("policy: service config: %s.%s = %v: %s", at, field, value, why)
	}
	hp := mc.HedgingPolicy
	switch {
	case hp.MaxAttempts == nil:
		return p, errs.Errorf("policy: service config: %s.maxAttempts is missing", at)
	case *hp.MaxAttempts < 2 || *hp.MaxAttempts != math.Trunc(*hp.MaxAttempts):
		return p, bad("maxAttempts", *hp.MaxAttempts, "must be a whole number of at least 2")
	}
	p.MaxAttempts = 0
	h := Hedging{MaxAttempts: maxAttempts(*hp.MaxAttempts), Delay: time.Nanosecond}
	if hp.HedgingDelay != nil {
		d, err := parseDuration(*hp.HedgingDelay)
		if err != nil {
			return p, errs.Errorf("policy: service config: %s.hedgingDelay = %s: %w", at, *hp.HedgingDelay, err)
		}
		h.Delay = max(d, time.Nanosecond)
	}
	for i, rc := range hp.NonFatalStatusCodes {
		c, err := parseCode(rc)
		if err != nil {
			return p, errs.Errorf("policy: service config: %s.nonFatalStatusCodes[%d] = %s: %w", at, i, rc, err)
		}
		h.NonFatalCodes = append(h.NonFatalCodes, c)
	}
	p.Hedging = h
	if err := p.Validate(); err != nil {
		return p, errs.Errorf("policy: service config: %s: %w", at, err)
	}
	return p, nil
}

// parseDuration reads a JSON string as a google.protobuf.Duration, the way
// gRPC's service config writes its durations: decimal seconds with an "s"
// suffix ("0.1s", "1.5s", ".01s"). protojson reads the syntax and durationpb
// checks the range; a negative duration is refused.
func parseDuration(raw json.RawMessage) (time.Duration, error) {
	var d durationpb.Duration
	if err := protojson.Unmarshal(raw, &d); err != nil {
		return 0, fmt.Errorf(`not a protobuf JSON duration (seconds with an "s" suffix, such as "0.1s"): %w`, err)
	}
	// protojson takes "." alone as zero seconds (".s"); gRPC and protobuf's
	// JSON mapping want at least one digit.
	var s string
	if err := json.Unmarshal(raw, &s); err != nil || !strings.ContainsAny(s, "0123456789") {
		return 0, errors.New(`not a protobuf JSON duration: no digits`)
	}
	if err := d.CheckValid(); err != nil {
		return 0, err
	}
	if d.GetSeconds() < 0 || d.GetNanos() < 0 {
		return 0, errors.New("must not be negative")
	}
	return d.AsDuration(), nil
}

// parseCode reads a status code as gRPC's own service config parser does,
// with codes.Code's UnmarshalJSON: a quoted upper-case name ("UNAVAILABLE")
// or a number (14). OK and CANCELLED are refused: neither is a failure to
// retry.
func parseCode(raw json.RawMessage) (codes.Code, error) {
	var c codes.Code
	if string(raw) == "null" { // UnmarshalJSON leaves c alone: not a code
		return 0, errors.New(`want a status code, an upper-case name such as "UNAVAILABLE" or a number from 0 to 16`)
	}
	if err := c.UnmarshalJSON(raw); err != nil {
		return 0, fmt.Errorf(`want an upper-case name such as "UNAVAILABLE" or a number from 0 to 16, as gRPC reads it: %w`, err)
	}
	if c == codes.OK || c == codes.Canceled {
		return 0, fmt.Errorf("%s is not a failure to retry", herdguard.CodeName(c))
	}
	return c, nil
}
