package stormlab

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// NotReturned is the outcome of a call without a deadline still running
// when a steady load stopped waiting for it (see DefaultPatience).
const NotReturned = "not returned"

// DefaultBucket is the width of the buckets a steady-load run's completions
// are counted in, at full scale.
const DefaultBucket = 250 * time.Millisecond

// RecoveredShare is the share of calls that must end ok in every bucket
// from some time on for a steady-load run to count as recovered then.
const RecoveredShare = 0.95

// Herd is the one-shot herd at capacity c: 1000 calls at once,
// 5 attempts, a 1 s first wait with full jitter; the sticky server takes c
// attempts per 100 ms and, once over, fails everything until arrivals have
// stayed within capacity for 1 s.
func Herd(c int) Scenario {
	sc := Overload()
	sc.Name, sc.Faults.Capacity, sc.herd = fmt.Sprintf("herd at C = %d", c), c, true
	return sc
}

// Herds are the herds at C = 20, 80 and 320.
func Herds() []Scenario { return []Scenario{Herd(20), Herd(80), Herd(320)} }

// HerdDeadline is Herd(c) with a deadline of 30 s on each call, as callers
// nearly always have: a pacer that knew C would serve every call within 6 s
// at C = 20.
func HerdDeadline(c int) Scenario {
	sc := Herd(c)
	sc.Name, sc.Deadline = fmt.Sprintf("herd at C = %d, 30 s deadlines", c), 30*time.Second
	return sc
}

// HerdsDeadline are the herds with deadlines at C = 20, 80 and 320.
func HerdsDeadline() []Scenario {
	return []Scenario{HerdDeadline(20), HerdDeadline(80), HerdDeadline(320)}
}

// IsHerd reports whether sc is one of the herds made by [Herd].
func (sc Scenario) IsHerd() bool { return sc.herd }

// steady is the steady load with a brownout: 600 calls/s for 12 s, each with a
// 2 s deadline, retried (when retried) by policy.Default; the server takes
// 800 attempts/s (80 per 100 ms window); from t = 3 s a trigger.
func steady(name string, model string, f func(*Faults)) Scenario {
	p := policy.Default()
	sc := Scenario{
		Name: name, Rate: 600, Duration: 12 * time.Second, Deadline: 2 * time.Second, Bucket: DefaultBucket,
		Attempts: p.MaxAttempts, Base: p.InitialBackoff, Cap: p.MaxBackoff,
		Faults: Faults{Model: model, Capacity: 80, CapacityWindow: DefaultWindow, RecoverAfter: time.Second,
			QueueLimit: time.Second, Seed: 1, Window: DefaultWindow, TriggerAt: 3 * time.Second},
	}
	f(&sc.Faults)
	return sc
}

// SteadyCut is steady load against the sticky server cut to 300 attempts/s
// (30 per window) for 2 s from t = 3 s.
func SteadyCut() Scenario {
	return steady("steady load, sticky, cut to 300/s for 2 s", ModelSticky, func(f *Faults) {
		f.TriggerFor, f.TriggerCapacity = 2*time.Second, 30
	})
}

// SteadyOutage is steady load against the sticky server with a full outage
// of 1 s from t = 3 s; it then needs 1 s of calm to recover.
func SteadyOutage() Scenario {
	return steady("steady load, sticky, 1 s outage", ModelSticky, func(f *Faults) {
		f.TriggerFor, f.TriggerOutage = time.Second, true
	})
}

// SteadyGentle is steady load against the gentle server (excess fails, the
// rest queues up to 1 s) cut to 300 attempts/s for 2 s from t = 3 s.
func SteadyGentle() Scenario {
	return steady("steady load, gentle, cut to 300/s for 2 s", ModelGentle, func(f *Faults) {
		f.TriggerFor, f.TriggerCapacity = 2*time.Second, 30
	})
}

// SteadyScenarios are the three brownouts: SteadyCut, SteadyOutage and
// SteadyGentle.
func SteadyScenarios() []Scenario { return []Scenario{SteadyCut(), SteadyOutage(), SteadyGentle()} }

// IsSteady reports whether sc is steady load with a brownout (its Rate is
// above 0, and it is neither a partial failure nor a dead server).
func (sc Scenario) IsSteady() bool { return sc.Rate > 0 && !sc.partial && !sc.dead }

func (sc Scenario) bucket() time.Duration {
	if sc.Bucket > 0 {
		return sc.Bucket
	}
	return DefaultBucket
}

// steadyCalls is how many calls a steady load starts.
func (sc Scenario) steadyCalls() int { return int(math.Round(sc.Rate * sc.Duration.Seconds())) }

// NoRetriesStrategy sends every call once, without a breaker: the baseline
// every overload control must beat.
func NoRetriesStrategy() Strategy {
	return Strategy{Name: "no retries", Policy: policy.Policy{MaxAttempts: 1}}
}

// ThrottlingStrategy is herdguard's defaults with gRPC's retry throttling
// at gRFC A6's usual 10 tokens and a token ratio of 0.1.
func ThrottlingStrategy(sc Scenario) Strategy {
	st := Strategies(sc)[len(Strategies(sc))-1]
	st.Name = "herdguard + throttling"
	st.Options = []interceptor.Option{interceptor.WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1})}
	return st
}

// HerdStrategies are those compared in the herds: all of Strategies, the
// budget, throttling and no retries.
func HerdStrategies(sc Scenario) []Strategy {
	return append(Strategies(sc), BudgetStrategy(sc), ThrottlingStrategy(sc), NoRetriesStrategy())
}

// SteadyStrategies are those compared under steady load: no retries;
// herdguard's defaults (policy.Default with the default breaker), alone,
// with the ratio budget and with throttling; full and decorrelated jitter
// without a breaker.
func SteadyStrategies() []Strategy {
	defaults := Strategy{Name: "herdguard defaults", Policy: policy.Default(), Breaker: &breaker.Settings{}}
	budget, throttling := defaults, defaults
	budget.Name, budget.Budget = "herdguard + budget", &policy.Budget{}
	throttling.Name = "herdguard + throttling"
	throttling.Options = []interceptor.Option{interceptor.WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1})}
	decorrelated := policy.Default()
	decorrelated.Jitter = policy.DecorrelatedJitter
	return []Strategy{
		NoRetriesStrategy(), defaults, budget, throttling,
		{Name: "exponential + full jitter", Policy: policy.Default()},
		{Name: "exponential + decorrelated", Policy: decorrelated},
	}
}

// Completion is how one call of a steady load went, as the client saw it.
type Completion struct {
	Start, End time.Duration // since the first call started
	Outcome    string        // "ok", herdguard's outcome, or "error <code>"
}

// OK reports whether the call succeeded.
func (c Completion) OK() bool { return c.Outcome == string(interceptor.OutcomeOK) }

// Steady is what the client recorded of a steady-load run. Its time 0 is
// the first call's start, which is also about when the server's clock
// started (at that call's arrival).
type Steady struct {
	Calls                    []Completion  // in start order
	TriggerStart, TriggerEnd time.Duration // both 0 without a trigger
	Bucket                   time.Duration // the width of the goodput buckets
	Rate                     float64       // calls started per second
}

// Goodput counts the completions per bucket by their end time: those that
// ended ok, and all of them.
func (s *Steady) Goodput() (ok, all []int) {
	if s == nil || s.Bucket <= 0 {
		return nil, nil
	}
	for _, c := range s.Calls {
		i := max(int(c.End/s.Bucket), 0)
		for len(all) <= i {
			ok, all = append(ok, 0), append(all, 0)
		}
		all[i]++
		if c.OK() {
			ok[i]++
		}
	}
	return ok, all
}

// Recovery is how long after the trigger ended every later bucket of
// completions was at least share ok (buckets with no completion count as
// ok); 0 if that held already when it ended. never is true when the last
// bucket falls short, or nothing completed.
func (s *Steady) Recovery(share float64) (d time.Duration, never bool) {
	ok, all := s.Goodput()
	k := len(all) // the first bucket of the run of good buckets that ends the series
	for i := len(all) - 1; i >= 0; i-- {
		if all[i] > 0 && float64(ok[i]) < share*float64(all[i]) {
			break
		}
		k = i
	}
	if k == len(all) {
		return 0, true
	}
	return max(time.Duration(k)*s.Bucket-s.TriggerEnd, 0), false
}

// runSteady starts the scenario's calls open loop and records each one;
// sc is scaled, and the server was just reset.
func (r *Runner) runSteady(ctx context.Context, sc Scenario, res Result, clients fleet, ctl demov1.GatewayServiceClient) (Result, error) {
	n := sc.steadyCalls()
	res.Calls = n
	st := &Steady{Calls: make([]Completion, 0, n), Bucket: sc.bucket(), Rate: sc.Rate}
	if f := sc.Faults; f.TriggerFor > 0 {
		st.TriggerStart, st.TriggerEnd = f.TriggerAt, f.TriggerAt+f.TriggerFor
	}
	calls := make([]Completion, n)
	var wg sync.WaitGroup
	t0 := time.Now()
	// Without a deadline, a call still running DefaultPatience after the
	// last one started is cut, and counted as not returned.
	patient, cut := ctx, context.CancelFunc(func() {})
	if sc.Deadline <= 0 {
		patient, cut = context.WithDeadline(ctx, t0.Add(sc.Duration+DefaultPatience))
	}
	defer cut()
	timer := time.NewTimer(0)
	<-timer.C
	started := 0
	for i := range n {
		// Each start is computed from t0, so a late tick is caught up on
		// instead of delaying every later call.
		if d := time.Until(t0.Add(time.Duration(float64(i) * float64(time.Second) / sc.Rate))); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		started++
		wg.Go(func() {
			start := time.Now()
			cctx, cancel := patient, context.CancelFunc(func() {})
			if sc.Deadline > 0 {
				cctx, cancel = context.WithTimeout(ctx, sc.Deadline)
			}
			_, err := clients.client(i).Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
			cancel()
			how := outcome(err)
			if sc.Deadline <= 0 && patient.Err() != nil && ctx.Err() == nil {
				how = NotReturned
			}
			calls[i] = Completion{Start: start.Sub(t0), End: time.Since(t0), Outcome: how}
		})
	}
	timer.Stop()
	wg.Wait()
	res.Elapsed = time.Since(t0)
	st.Calls = calls[:started]
	return r.steadyResult(ctx, res, st, ctl)
}

// steadyResult fills res from the calls st recorded and the server's
// counts.
func (r *Runner) steadyResult(ctx context.Context, res Result, st *Steady, ctl demov1.GatewayServiceClient) (Result, error) {
	res.Calls = len(st.Calls)
	res.Steady = st
	res.Outcomes = map[string]int{}
	for _, c := range st.Calls {
		res.Outcomes[c.Outcome]++
		if c.OK() {
			res.Succeeded++
			res.Latencies = append(res.Latencies, c.End-c.Start)
		} else {
			res.FailedLatencies = append(res.FailedLatencies, c.End-c.Start)
		}
	}
	return finishResult(ctx, res, ctl)
}

// finishResult sorts res's latencies, fills in what its calls and outcomes
// give, and reads the server's counts.
func finishResult(ctx context.Context, res Result, ctl demov1.GatewayServiceClient) (Result, error) {
	slices.Sort(res.Latencies)
	slices.Sort(res.FailedLatencies)
	res.Failed = res.Calls - res.Succeeded
	res.FastFails = res.Outcomes[string(interceptor.OutcomeBreakerOpen)]
	res.BudgetRefusals = res.Outcomes[string(interceptor.OutcomeBudgetExhausted)]
	var err error
	res.Stats, err = ctl.GetStats(ctx, &demov1.GetStatsRequest{})
	if err != nil {
		return res, fmt.Errorf("read the server's counts: %w", err)
	}
	return res, ctx.Err()
}

// Bound is the best any client could do in a scenario, to show beside
// what each strategy did.
type Bound struct {
	// Attempts is the fewest attempts the server must receive; for a herd,
	// every call once plus one retry of each the first window turned away.
	Attempts int
	// LastSuccess is, for a herd, the soonest the last call can succeed:
	// the first window, the calm the server needs, then a window of
	// capacity for every capacity-full of calls left.
	LastSuccess time.Duration
	// OK is the most calls that can succeed.
	OK    int
	Calls int
}

// Bound returns the best possible numbers of a herd (sc.IsHerd) or a steady
// load (sc.IsSteady), at sc's scale; ok is false for other scenarios.
//
// For a steady load it is a knowing client's: it sends each call when the
// server can take it, oldest first, until the call's deadline; but it
// cannot know when the trigger comes, so a trigger that takes the sticky
// server over capacity in its first window overloads it, and it then needs
// its calm before taking work again.
func (sc Scenario) Bound() (b Bound, ok bool) {
	f := sc.Faults.withDefaults()
	switch {
	case sc.IsHerd() && f.Capacity > 0:
		c := f.Capacity
		b = Bound{Calls: sc.Calls, OK: sc.Calls, Attempts: sc.Calls}
		if left := sc.Calls - c; left > 0 {
			// The first window overloads the server; it recovers at the
			// first window boundary after its calm, and then takes C
			// retries per window: the last ones can succeed as the last
			// window they need begins.
			w := f.CapacityWindow
			calm := (f.RecoverAfter + w - 1) / w * w
			b.Attempts += left
			b.LastSuccess = calm + time.Duration((left+c-1)/c)*w
		}
		return b, true
	case sc.IsSteady():
		b.Calls = sc.steadyCalls()
		b.Attempts, b.OK = b.Calls, steadyBest(sc, f)
		return b, true
	}
	return Bound{}, false
}

// steadyBest counts the calls a knowing client gets through a steady load,
// window by window: each window the server takes up to its capacity of the
// calls waiting, oldest first, and a call whose deadline passed before the
// window began is lost.
func steadyBest(sc Scenario, f Faults) int {
	n, w := sc.steadyCalls(), f.CapacityWindow
	startOf := func(i int) time.Duration { return time.Duration(float64(i) * float64(time.Second) / sc.Rate) }
	var downFrom, downTo time.Duration
	if f.Model == ModelSticky && f.TriggerFor > 0 {
		if c, _ := f.capacityAt(f.TriggerAt); sc.Rate*w.Seconds() > float64(c) {
			// The server's windows start at multiples of w: the trigger's
			// first is the first to start at or after TriggerAt, and the
			// server recovers at the first window start at least
			// RecoverAfter after the calm began, the window after it.
			downFrom = (f.TriggerAt + w - 1) / w * w
			downTo = downFrom + w + (f.RecoverAfter+w-1)/w*w
		}
	}
	okCalls, next, head := 0, 0, 0 // calls [head, next) wait, oldest first
	for t := time.Duration(0); next < n || head < next; t += w {
		for next < n && startOf(next) < t+w {
			next++
		}
		for head < next && startOf(head)+sc.Deadline < t {
			head++ // lost
		}
		c, limited := f.capacityAt(t)
		if t > downFrom && t < downTo {
			// Down: the trigger's first window served its capacity, then
			// the rest of it overloaded the server.
			c, limited = 0, true
		}
		if !limited {
			c = next - head
		}
		served := min(c, next-head)
		okCalls += served
		head += served
	}
	return okCalls
}
