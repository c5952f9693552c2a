package budget_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/budget"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/policy"
)

func TestThrottleFollowsGRPC(t *testing.T) {
	th, err := budget.NewThrottle(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	// 10 tokens; a retry is allowed while more than 5 are left after the failure
	for i, want := range []bool{true, true, true, true, false, false} {
		if got := th.Failure(); got != want {
			t.Fatalf("failure %d: retry allowed %v, want %v (tokens %v)", i+1, got, want, th.Tokens())
		}
	}
	if got := th.Tokens(); got != 4 {
		t.Fatalf("tokens %v, want 4", got)
	}
	for range 11 {
		th.Success()
	}
	if got := th.Tokens(); math.Abs(got-5.1) > 1e-9 { // in float64, as grpc-go adds them
		t.Fatalf("tokens %v after 11 successes at 0.1, want 5.1", got)
	}
	if th.Failure() {
		t.Error("4.1 tokens left: a retry must not be allowed")
	}
	for range 1000 {
		th.Success()
	}
	if got := th.Tokens(); got != 10 {
		t.Errorf("tokens %v, want capped at 10", got)
	}
	for range 20 {
		th.Failure()
	}
	if got := th.Tokens(); got != 0 {
		t.Errorf("tokens %v, want floored at 0", got)
	}
}

// grpc-go counts tokens in float64 without rounding (its retryThrottler):
// the throttle takes the same decisions and keeps the same count, bit for
// bit, for ratios finer than thousandths and maxTokens that thousandths
// cannot hold exactly.
func TestThrottleCountsAsGRPCGo(t *testing.T) {
	for _, cfg := range []policy.Throttling{
		{MaxTokens: 4.007, TokenRatio: 0.997},
		{MaxTokens: 2, TokenRatio: 0.0004},
		{MaxTokens: 10, TokenRatio: 0.0015},
		{MaxTokens: 1000, TokenRatio: 0.1},
	} {
		th, err := budget.NewThrottle(cfg)
		if err != nil {
			t.Fatalf("%+v: %v", cfg, err)
		}
		// grpc-go's arithmetic, as its retryThrottler does it.
		tokens, thresh := cfg.MaxTokens, cfg.MaxTokens/2
		rnd := rand.New(rand.NewPCG(1, 2))
		for step := range 5000 {
			if rnd.IntN(3) == 0 {
				tokens = max(tokens-1, 0)
				want := tokens > thresh
				if got := th.Failure(); got != want {
					t.Fatalf("%+v, step %d: Failure() = %v with %v tokens; grpc-go: %v with %v", cfg, step, got, th.Tokens(), want, tokens)
				}
			} else {
				tokens = min(tokens+cfg.TokenRatio, cfg.MaxTokens)
				th.Success()
			}
			if got := th.Tokens(); got != tokens {
				t.Fatalf("%+v, step %d: %v tokens, grpc-go has %v", cfg, step, got, tokens)
			}
		}
	}
	// A ratio thousandths would round to 0 still refills the bucket.
	th, _ := budget.NewThrottle(policy.Throttling{MaxTokens: 2, TokenRatio: 0.0004})
	if th.Failure() {
		t.Fatal("a retry allowed at 1 of 2 tokens")
	}
	th.Success()
	if !th.Allowed() {
		t.Errorf("retries refused at %v of 2 tokens; grpc-go allows them above 1", th.Tokens())
	}
}

func TestThrottleConcurrent(t *testing.T) {
	th, _ := budget.NewThrottle(policy.Throttling{MaxTokens: 1000, TokenRatio: 1})
	var wg sync.WaitGroup
	for range 400 {
		wg.Go(func() { th.Failure() })
		wg.Go(func() { th.Success() })
	}
	wg.Wait()
	// successes at the cap are lost, so the total lies in [600, 1000]
	if got := th.Tokens(); got < 600 || got > 1000 {
		t.Errorf("tokens %v after 400 failures and 400 successes from 1000", got)
	}
}

func TestThrottleValidate(t *testing.T) {
	for _, tt := range []struct {
		t    policy.Throttling
		want string
	}{
		{policy.Throttling{MaxTokens: 0, TokenRatio: 1}, "MaxTokens = 0"},
		{policy.Throttling{MaxTokens: 1001, TokenRatio: 1}, "MaxTokens = 1001"},
		{policy.Throttling{MaxTokens: 10, TokenRatio: 0}, "TokenRatio = 0"},
		{policy.Throttling{MaxTokens: 10, TokenRatio: -0.5}, "TokenRatio = -0.5"},
		{policy.Throttling{MaxTokens: 10, TokenRatio: math.Inf(1)}, "TokenRatio = +Inf"},
	} {
		if _, err := budget.NewThrottle(tt.t); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("NewThrottle(%+v) = %v, want an error with %q", tt.t, err, tt.want)
		}
	}
}

// newRatio is a Ratio on a manual clock that starts at the Unix epoch.
func newRatio(t *testing.T, b policy.Budget) (*budget.Ratio, *testutil.Clock) {
	t.Helper()
	c := testutil.NewClock(time.Unix(0, 0))
	r, err := budget.NewRatio(b, c.Now)
	if err != nil {
		t.Fatal(err)
	}
	return r, c
}

func TestRatioBudget(t *testing.T) {
	// reserve: 1/s × 10s = 10 retries; plus 20 % of the calls
	r, c := newRatio(t, policy.Budget{Ratio: 0.2, MinPerSecond: 1, Window: 10 * time.Second})
	allowed := 0
	for range 15 {
		if r.TryRetry() {
			allowed++
		}
	}
	if allowed != 10 {
		t.Fatalf("a quiet client got %d retries, want the reserve of 10", allowed)
	}
	for range 100 {
		r.Call()
	}
	allowed = 0
	for range 50 {
		if r.TryRetry() {
			allowed++
		}
	}
	if allowed != 20 {
		t.Fatalf("after 100 calls: %d more retries, want 20", allowed)
	}
	if calls, retries := r.Counts(); calls != 100 || retries != 30 {
		t.Errorf("counts %d calls, %d retries; want 100 and 30", calls, retries)
	}
	// half the window later the counts are still there...
	c.Advance(5 * time.Second)
	if r.TryRetry() {
		t.Error("a retry was allowed with the budget spent")
	}
	// ...and a whole window later they are gone
	c.Advance(10 * time.Second)
	if calls, retries := r.Counts(); calls != 0 || retries != 0 {
		t.Errorf("a window later: %d calls, %d retries; want none", calls, retries)
	}
	if !r.TryRetry() {
		t.Error("a new window must allow the reserve again")
	}
}

func TestRatioSlides(t *testing.T) {
	r, c := newRatio(t, policy.Budget{Ratio: 1, MinPerSecond: 0.1, Window: 10 * time.Second}) // reserve 1
	for range 10 {
		r.Call()
	}
	c.Advance(6 * time.Second)
	for range 10 {
		r.Call()
	}
	c.Advance(5 * time.Second) // the first 10 calls fell out, the second 10 remain
	if calls, _ := r.Counts(); calls != 10 {
		t.Errorf("calls in the window %d, want 10", calls)
	}
}

func TestRatioDefaultsAndValidate(t *testing.T) {
	d := policy.Budget{}.WithDefaults()
	if d.Ratio != 0.2 || d.MinPerSecond != 10 || d.Window != 10*time.Second {
		t.Errorf("defaults %+v", d)
	}
	for _, tt := range []struct {
		b    policy.Budget
		want string
	}{
		{policy.Budget{Ratio: -1}, "Ratio = -1"},
		{policy.Budget{MinPerSecond: -2}, "MinPerSecond = -2"},
		{policy.Budget{Window: -time.Second}, "Window = -1s"},
		{policy.Budget{Window: time.Millisecond}, "Window = 1ms"},
	} {
		if _, err := budget.NewRatio(tt.b, nil); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("NewRatio(%+v) = %v, want %q", tt.b, err, tt.want)
		}
	}
}

func TestRatioExactUnderConcurrency(t *testing.T) {
	r, _ := newRatio(t, policy.Budget{Ratio: 0.5, MinPerSecond: 0.1, Window: 10 * time.Second}) // reserve 1
	for range 1000 {
		r.Call()
	}
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range 2000 {
		wg.Go(func() {
			if r.TryRetry() {
				allowed.Add(1)
			}
		})
	}
	wg.Wait()
	if got := allowed.Load(); got != 501 {
		t.Errorf("%d retries allowed, want exactly 501 (0.5 × 1000 + 1)", got)
	}
}

func TestNoAllocations(t *testing.T) {
	th, _ := budget.NewThrottle(policy.Throttling{MaxTokens: 10, TokenRatio: 1})
	r, _ := budget.NewRatio(policy.Budget{}, nil)
	if a := testing.AllocsPerRun(100, func() { th.Failure(); th.Success(); r.Call(); r.TryRetry() }); a != 0 {
		t.Errorf("%v allocations per call, want 0", a)
	}
}

func TestThrottleAllowed(t *testing.T) {
	th, err := budget.NewThrottle(policy.Throttling{MaxTokens: 4, TokenRatio: 1})
	if err != nil {
		t.Fatal(err)
	}
	// 4 tokens; threshold 2: allowed while more than 2 are left
	for i, want := range []bool{true, false, false} { // after failures: 3, 2, 1 tokens
		if got := th.Failure(); got != want || th.Allowed() != want {
			t.Errorf("after failure %d: Failure = %v, Allowed = %v; want %v for both", i+1, got, th.Allowed(), want)
		}
	}
	th.Success() // 2: not more than half
	if th.Allowed() {
		t.Errorf("Allowed with %v of 4 tokens", th.Tokens())
	}
	th.Success() // 3
	if !th.Allowed() {
		t.Errorf("not Allowed with %v of 4 tokens", th.Tokens())
	}
	if th.Tokens() != 3 {
		t.Errorf("Allowed took a token: %v left, want 3", th.Tokens())
	}
}

func TestRatioAllowedCountsNothing(t *testing.T) {
	r, _ := newRatio(t, policy.Budget{Ratio: 0.5, MinPerSecond: 0.1, Window: 10 * time.Second}) // a reserve of 1
	for range 3 {
		if !r.Allowed() {
			t.Fatal("Allowed refused with the reserve untouched")
		}
	}
	if !r.TryRetry() {
		t.Fatal("the reserve's one retry was refused")
	}
	if r.Allowed() {
		t.Error("Allowed with the budget spent")
	}
	r.Call()
	r.Call() // 0.5 × 2 calls: room for one more
	if !r.Allowed() || !r.TryRetry() || r.Allowed() {
		t.Error("after 2 calls, want room for exactly one more retry")
	}
}
