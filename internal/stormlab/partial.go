package stormlab

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// PartialShares are the shares of attempts a server fails on its own in
// the partial-failure scenarios: 1 is a dead server.
var PartialShares = []float64{0.3, 0.5, 0.67, 0.8, 1}

// ClosedLoopWorkers is how many callers a closed-loop partial failure has.
const ClosedLoopWorkers = 16

// Partial is the partial failure of issue 32, open loop: 600 calls/s for
// 6 s, each with a 2 s deadline, retried (when retried) by policy.Default.
// The server has no capacity limit and answers at once, but fails each
// attempt on its own with probability p, with Unavailable: dead replicas
// behind a proxy, a bad shard, a flapping dependency. Holding attempts back
// cannot help it: retries alone get 1 - p³ of the calls through.
func Partial(p float64) Scenario {
	pol := policy.Default()
	return Scenario{
		Name: fmt.Sprintf("partial failure %g, open loop", p), Rate: 600, Duration: 6 * time.Second,
		Deadline: 2 * time.Second, Bucket: DefaultBucket,
		Attempts: pol.MaxAttempts, Base: pol.InitialBackoff, Cap: pol.MaxBackoff,
		Faults:  Faults{FailRate: p, Seed: 1, Window: DefaultWindow},
		partial: true,
	}
}

// ClosedPartial is the same server called in a closed loop:
// ClosedLoopWorkers callers, each making one call after another for 6 s,
// each call with a 2 s deadline, retried (when retried) by policy.Default
// with waits of 1 to 10 ms (InitialBackoff 1 ms, MaxBackoff 10 ms), as a
// batch job or a fan-out would call.
func ClosedPartial(p float64) Scenario {
	sc := Partial(p)
	sc.Name = fmt.Sprintf("partial failure %g, closed loop", p)
	sc.Rate, sc.Workers = 0, ClosedLoopWorkers
	sc.Base, sc.Cap = time.Millisecond, 10*time.Millisecond
	return sc
}

// PartialOpen is Partial at every share of PartialShares.
func PartialOpen() []Scenario { return partialAt(Partial) }

// PartialClosed is ClosedPartial at every share of PartialShares.
func PartialClosed() []Scenario { return partialAt(ClosedPartial) }

// PartialScenarios are PartialOpen, then PartialClosed.
func PartialScenarios() []Scenario { return append(PartialOpen(), PartialClosed()...) }

func partialAt(f func(float64) Scenario) []Scenario {
	out := make([]Scenario, len(PartialShares))
	for i, p := range PartialShares {
		out[i] = f(p)
	}
	return out
}

// IsPartial reports whether sc is one of the partial failures.
func (sc Scenario) IsPartial() bool { return sc.partial }

// IsClosedLoop reports whether sc calls in a closed loop (Workers above 0).
func (sc Scenario) IsClosedLoop() bool { return sc.Workers > 0 }

// The partial-failure strategies' names that the tables and tests use.
const (
	RetriesAlone     = "retries alone"
	HerdguardDefault = "herdguard defaults"
	BreakerOnly      = "herdguard, breaker only"
	OverloadOnly     = "herdguard, overload control only"
)

// PartialStrategies are those compared in a partial failure: no retries;
// the scenario's retry policy alone (no breaker, no overload control);
// herdguard's defaults (the policy, the default breaker and overload
// control); and each protection alone.
func PartialStrategies(sc Scenario) []Strategy {
	p := policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: sc.Base, MaxBackoff: sc.Cap}
	return []Strategy{
		NoRetriesStrategy(),
		{Name: RetriesAlone, Policy: p},
		{Name: HerdguardDefault, Policy: p, Breaker: &breaker.Settings{}},
		{Name: BreakerOnly, Policy: p, Breaker: &breaker.Settings{}, Options: []interceptor.Option{interceptor.WithoutOverloadControl()}},
		{Name: OverloadOnly, Policy: p, Breaker: &breaker.Settings{}, Options: []interceptor.Option{interceptor.WithoutBreaker()}},
	}
}

// runClosed runs the scenario's workers in a closed loop, each making one
// call after another until sc.Duration has passed, and counts how the calls
// ended (a call refused at once comes back in microseconds, so a run can
// make millions: only counts and the successes' latencies are kept); sc is
// scaled, and the server was just reset.
func (r *Runner) runClosed(ctx context.Context, sc Scenario, res Result, client demov1.GatewayServiceClient, ctl demov1.GatewayServiceClient) (Result, error) {
	type tally struct {
		outcomes  map[string]int
		latencies []time.Duration
	}
	t0 := time.Now()
	end := t0.Add(sc.Duration)
	per := make([]tally, sc.Workers)
	var wg sync.WaitGroup
	for w := range sc.Workers {
		wg.Go(func() {
			t := tally{outcomes: map[string]int{}}
			for ctx.Err() == nil {
				start := time.Now()
				if !start.Before(end) {
					break
				}
				cctx, cancel := context.WithTimeout(ctx, sc.Deadline)
				_, err := client.Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
				cancel()
				t.outcomes[outcome(err)]++
				if err == nil {
					t.latencies = append(t.latencies, time.Since(start))
				}
			}
			per[w] = t
		})
	}
	wg.Wait()
	res.Elapsed = time.Since(t0)
	res.Outcomes = map[string]int{}
	res.Calls = 0
	for _, t := range per {
		for o, n := range t.outcomes {
			res.Outcomes[o] += n
			res.Calls += n
		}
		res.Latencies = append(res.Latencies, t.latencies...)
	}
	slices.Sort(res.Latencies)
	res.Succeeded = len(res.Latencies)
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

// OKPerSecond is the calls that succeeded per second of the run's
// duration: a closed loop's throughput.
func (r Result) OKPerSecond(sc Scenario) float64 {
	return float64(r.Succeeded) / sc.Duration.Seconds()
}
