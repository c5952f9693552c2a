package policy_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/policy"
)

const ms = time.Millisecond

func TestRawBackoffTable(t *testing.T) {
	p := policy.Policy{InitialBackoff: 10 * ms, Multiplier: 2, MaxBackoff: 100 * ms, Jitter: policy.NoJitter}
	want := []time.Duration{10 * ms, 20 * ms, 40 * ms, 80 * ms, 100 * ms, 100 * ms}
	for i, w := range want {
		if got := p.RawBackoff(i + 1); got != w {
			t.Errorf("RawBackoff(%d) = %v, want %v", i+1, got, w)
		}
		if got := p.Backoff(i+1, 0, 0.7); got != w {
			t.Errorf("NoJitter Backoff(%d) = %v, want %v", i+1, got, w)
		}
	}
}

func TestRawBackoffNeverOverflows(t *testing.T) {
	p := policy.Policy{InitialBackoff: time.Hour, Multiplier: 1e300, MaxBackoff: 1000 * time.Hour}
	for _, n := range []int{1, 2, 3, 64, 1 << 20, math.MaxInt32, math.MaxInt} {
		got := p.RawBackoff(n)
		if got <= 0 || got > p.MaxBackoff {
			t.Errorf("RawBackoff(%d) = %v, want in (0, %v]", n, got, p.MaxBackoff)
		}
	}
	if got := p.RawBackoff(0); got != time.Hour {
		t.Errorf("RawBackoff(0) = %v, want the initial backoff", got)
	}
}

func TestRawBackoffMultiplierOneIsFixed(t *testing.T) {
	p := policy.Policy{InitialBackoff: time.Second, Multiplier: 1}
	for n := 1; n <= 5; n++ {
		if got := p.RawBackoff(n); got != time.Second {
			t.Errorf("RawBackoff(%d) = %v, want 1s", n, got)
		}
	}
}

// TestJitterApply gives the exact wait of each jitter for the random numbers
// 0, 0.25, 0.5 and 1, with a raw wait of 40ms, InitialBackoff 10ms and
// MaxBackoff 100ms.
func TestJitterApply(t *testing.T) {
	const raw, base, ceiling = 40 * ms, 10 * ms, 100 * ms
	rs := []float64{0, 0.25, 0.5, 1}
	tests := []struct {
		name string
		j    policy.Jitter
		prev time.Duration
		want []time.Duration // one per r in rs
	}{
		{"zero value", 0, 0, []time.Duration{0, 10 * ms, 20 * ms, 40 * ms}},
		{"full", policy.FullJitter, 0, []time.Duration{0, 10 * ms, 20 * ms, 40 * ms}},
		{"none", policy.NoJitter, 0, []time.Duration{40 * ms, 40 * ms, 40 * ms, 40 * ms}},
		{"equal", policy.EqualJitter, 0, []time.Duration{20 * ms, 25 * ms, 30 * ms, 40 * ms}},
		// decorrelated: base + r*(min(ceiling, 3*prev) - base); prev 0 means base.
		{"decorrelated first", policy.DecorrelatedJitter, 0, []time.Duration{10 * ms, 15 * ms, 20 * ms, 30 * ms}},
		{"decorrelated prev 30ms", policy.DecorrelatedJitter, 30 * ms, []time.Duration{10 * ms, 30 * ms, 50 * ms, 90 * ms}},
		{"decorrelated capped", policy.DecorrelatedJitter, 90 * ms, []time.Duration{10 * ms, 32500 * time.Microsecond, 55 * ms, 100 * ms}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i, r := range rs {
				if got := tt.j.Apply(raw, tt.prev, base, ceiling, r); got != tt.want[i] {
					t.Errorf("%v.Apply(raw %v, prev %v, r %v) = %v, want %v", tt.j, raw, tt.prev, r, got, tt.want[i])
				}
			}
		})
	}
}

func TestJitterApplyClampsRandomNumbers(t *testing.T) {
	const raw, base, ceiling = 40 * ms, 10 * ms, 100 * ms
	tests := []struct {
		r    float64
		want time.Duration
	}{
		{-3, 0},
		{math.NaN(), 0},
		{7, 40 * ms},
	}
	for _, tt := range tests {
		if got := policy.FullJitter.Apply(raw, 0, base, ceiling, tt.r); got != tt.want {
			t.Errorf("FullJitter.Apply(raw %v, r %v) = %v, want %v", raw, tt.r, got, tt.want)
		}
	}
}

// TestPartialLiteralWaitsWithFullJitter: a Policy literal that sets only
// MaxAttempts waits as Default does, with full jitter.
func TestPartialLiteralWaitsWithFullJitter(t *testing.T) {
	p := policy.Policy{MaxAttempts: 5}
	if p.Jitter != policy.FullJitter {
		t.Errorf("Policy{MaxAttempts: 5}.Jitter = %v, want full", p.Jitter)
	}
	// raw waits 100ms, 200ms, 400ms, 800ms; full jitter scales each by r.
	tests := []struct {
		retry int
		r     float64
		want  time.Duration
	}{
		{1, 0, 0},
		{1, 0.25, 25 * ms},
		{1, 0.5, 50 * ms},
		{1, 1, 100 * ms},
		{2, 0.5, 100 * ms},
		{3, 0.25, 100 * ms},
		{4, 1, 800 * ms},
	}
	d := policy.Default()
	for _, tt := range tests {
		if got := p.Backoff(tt.retry, 0, tt.r); got != tt.want {
			t.Errorf("Policy{MaxAttempts: 5}.Backoff(%d, 0, %v) = %v, want %v", tt.retry, tt.r, got, tt.want)
		}
		if got := d.Backoff(tt.retry, 0, tt.r); got != tt.want {
			t.Errorf("Default().Backoff(%d, 0, %v) = %v, want %v", tt.retry, tt.r, got, tt.want)
		}
	}
	if w := p.WithDefaults(); w.MaxAttempts != 5 || w.Jitter != policy.FullJitter {
		t.Errorf("Policy{MaxAttempts: 5}.WithDefaults() = %+v, want 5 attempts with full jitter", w)
	}
}

// TestBackoffTablePerJitter walks six retries of each jitter kind with fixed
// random numbers, as the interceptor does, feeding each wait back as prev.
func TestBackoffTablePerJitter(t *testing.T) {
	p := policy.Policy{InitialBackoff: 10 * ms, Multiplier: 2, MaxBackoff: 100 * ms}
	rs := []float64{0.5, 0.25, 1, 0, 0.5, 0.75}
	tests := []struct {
		j    policy.Jitter
		want []time.Duration
	}{
		{policy.NoJitter, []time.Duration{10 * ms, 20 * ms, 40 * ms, 80 * ms, 100 * ms, 100 * ms}},
		{policy.FullJitter, []time.Duration{5 * ms, 5 * ms, 40 * ms, 0, 50 * ms, 75 * ms}},
		{policy.EqualJitter, []time.Duration{7500 * time.Microsecond, 12500 * time.Microsecond, 40 * ms, 40 * ms, 75 * ms, 87500 * time.Microsecond}},
		// 10+.5*(30-10)=20; 10+.25*(60-10)=22.5; 10+1*(67.5-10)=67.5; 10; 10+.5*20=20; 10+.75*50=47.5
		{policy.DecorrelatedJitter, []time.Duration{20 * ms, 22500 * time.Microsecond, 67500 * time.Microsecond, 10 * ms, 20 * ms, 47500 * time.Microsecond}},
	}
	for _, tt := range tests {
		t.Run(tt.j.String(), func(t *testing.T) {
			p := p
			p.Jitter = tt.j
			var prev time.Duration
			for i, want := range tt.want {
				got := p.Backoff(i+1, prev, rs[i])
				if got != want {
					t.Errorf("retry %d: Backoff = %v, want %v", i+1, got, want)
				}
				prev = got
			}
		})
	}
}

func TestJitterStringAndParse(t *testing.T) {
	for _, tt := range []struct {
		j    policy.Jitter
		name string
	}{{policy.NoJitter, "none"}, {policy.FullJitter, "full"}, {policy.EqualJitter, "equal"}, {policy.DecorrelatedJitter, "decorrelated"}} {
		if got := tt.j.String(); got != tt.name {
			t.Errorf("%d.String() = %q, want %q", int(tt.j), got, tt.name)
		}
		got, err := policy.ParseJitter(strings.ToUpper(tt.name))
		if err != nil || got != tt.j {
			t.Errorf("ParseJitter(%q) = %v, %v; want %v, nil", strings.ToUpper(tt.name), got, err, tt.j)
		}
	}
	if policy.NoJitter == 0 {
		t.Error("NoJitter is the zero value; the zero value must be FullJitter")
	}
	if got := policy.Jitter(0).String(); got != "full" {
		t.Errorf("Jitter(0).String() = %q, want %q", got, "full")
	}
	if got := policy.Jitter(9).String(); got != "Jitter(9)" {
		t.Errorf("Jitter(9).String() = %q", got)
	}
	if _, err := policy.ParseJitter("wobbly"); err == nil || !strings.Contains(err.Error(), `"wobbly"`) {
		t.Errorf("ParseJitter(wobbly) error = %v, want one naming the value", err)
	}
}

func TestDefaults(t *testing.T) {
	d := policy.Default()
	if d.MaxAttempts != 3 || d.InitialBackoff != 100*ms || d.MaxBackoff != 10*time.Second ||
		d.Multiplier != 2 || d.Jitter != policy.FullJitter || d.PerAttemptTimeout != 0 {
		t.Errorf("Default() = %+v", d)
	}
	if err := d.Validate(); err != nil {
		t.Errorf("Default().Validate() = %v", err)
	}
	z := policy.Policy{}.WithDefaults()
	if z.MaxAttempts != 3 || z.InitialBackoff != 100*ms || z.MaxBackoff != 10*time.Second || z.Multiplier != 2 {
		t.Errorf("zero WithDefaults() = %+v", z)
	}
	if len(z.RetryableCodes) != 2 || !z.Retryable(codes.Unavailable) || !z.Retryable(codes.ResourceExhausted) || z.Retryable(codes.Internal) {
		t.Errorf("zero WithDefaults().RetryableCodes = %v", z.RetryableCodes)
	}
	if got := (policy.Policy{InitialBackoff: time.Minute}).WithDefaults().MaxBackoff; got != time.Minute {
		t.Errorf("MaxBackoff default with a 1m InitialBackoff = %v, want 1m", got)
	}
	own := []codes.Code{codes.Internal}
	w := policy.Policy{RetryableCodes: own}.WithDefaults()
	own[0] = codes.NotFound
	if w.RetryableCodes[0] != codes.Internal {
		t.Error("WithDefaults shares the caller's RetryableCodes slice")
	}
}

func TestRetryable(t *testing.T) {
	var zero policy.Policy
	if !zero.Retryable(codes.Unavailable) || zero.Retryable(codes.NotFound) {
		t.Error("zero policy must retry exactly the default codes")
	}
	p := policy.Policy{RetryableCodes: []codes.Code{codes.Internal}}
	if !p.Retryable(codes.Internal) || p.Retryable(codes.Unavailable) {
		t.Error("an explicit RetryableCodes list must replace the defaults")
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name  string
		p     policy.Policy
		field string // must appear in the error
		value string // must appear in the error
	}{
		{"negative attempts", policy.Policy{MaxAttempts: -1}, "MaxAttempts", "-1"},
		{"negative initial", policy.Policy{InitialBackoff: -ms}, "InitialBackoff", "-1ms"},
		{"negative max", policy.Policy{MaxBackoff: -ms}, "MaxBackoff", "-1ms"},
		{"max below initial", policy.Policy{InitialBackoff: 50 * ms, MaxBackoff: 10 * ms}, "MaxBackoff", "10ms"},
		{"max below default initial", policy.Policy{MaxBackoff: 10 * ms}, "MaxBackoff", "100ms"},
		{"multiplier below one", policy.Policy{Multiplier: 0.5}, "Multiplier", "0.5"},
		{"negative multiplier", policy.Policy{Multiplier: -2}, "Multiplier", "-2"},
		{"NaN multiplier", policy.Policy{Multiplier: math.NaN()}, "Multiplier", "NaN"},
		{"Inf multiplier", policy.Policy{Multiplier: math.Inf(1)}, "Multiplier", "+Inf"},
		{"unknown jitter", policy.Policy{Jitter: 7}, "Jitter", "7"},
		{"jitter just past the last", policy.Policy{Jitter: policy.DecorrelatedJitter + 1}, "Jitter", "4"},
		{"negative jitter", policy.Policy{Jitter: -1}, "Jitter", "-1"},
		{"negative per-attempt timeout", policy.Policy{PerAttemptTimeout: -ms}, "PerAttemptTimeout", "-1ms"},
		{"OK retryable", policy.Policy{RetryableCodes: []codes.Code{codes.Unavailable, codes.OK}}, "RetryableCodes[1]", "OK"},
		{"Canceled retryable", policy.Policy{RetryableCodes: []codes.Code{codes.Canceled}}, "RetryableCodes[0]", "Canceled"},
		{"unknown code", policy.Policy{RetryableCodes: []codes.Code{42}}, "RetryableCodes[0]", "42"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.p.Validate()
			if err == nil {
				t.Fatalf("Validate(%+v) = nil, want an error", tt.p)
			}
			if !strings.Contains(err.Error(), tt.field) || !strings.Contains(err.Error(), tt.value) {
				t.Errorf("Validate() = %q, want it to name %s and %s", err, tt.field, tt.value)
			}
		})
	}
	for _, ok := range []policy.Policy{
		{},
		{MaxAttempts: 1},
		{Multiplier: 1},
		{InitialBackoff: 10 * ms, MaxBackoff: 10 * ms},
		{RetryableCodes: []codes.Code{codes.DeadlineExceeded, codes.Internal}},
		{Jitter: policy.DecorrelatedJitter, PerAttemptTimeout: time.Second},
		{Jitter: 0},
		{Jitter: policy.FullJitter},
		{Jitter: policy.NoJitter},
		{Jitter: policy.EqualJitter},
	} {
		if err := ok.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v, want nil", ok, err)
		}
	}
}

func FuzzBackoffStaysInBounds(f *testing.F) {
	f.Add(int64(10*ms), int64(100*ms), 2.0, 3, int64(0), 0.5, 1)
	f.Fuzz(func(t *testing.T, initial, ceiling int64, mult float64, retry int, prev int64, r float64, j int) {
		p := policy.Policy{InitialBackoff: time.Duration(initial), MaxBackoff: time.Duration(ceiling), Multiplier: mult, Jitter: policy.Jitter(j)}
		if p.Validate() != nil {
			return
		}
		d := p.Backoff(retry, time.Duration(max(prev, 0)), r)
		if lim := p.WithDefaults().MaxBackoff; d < 0 || d > lim {
			t.Fatalf("Backoff(%d) = %v outside [0, %v] for %+v", retry, d, lim, p)
		}
	})
}
