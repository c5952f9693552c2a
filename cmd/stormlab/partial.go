package stormlab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"

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

// Partial is the partial failure, open loop: 600 calls/s for
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

// PartialShort is the short form make demo runs: each loop at p = 0.67
// and at a dead server.
func PartialShort() []Scenario {
	return []Scenario{Partial(0.67), Partial(1), ClosedPartial(0.67), ClosedPartial(1)}
}

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
// control); each protection alone; and gRPC's built-in retry with the
// same attempts and waits (GRPCRetryStrategy). The other peers, which
// herdguard's module does not depend on, run beside them in module bench's
// storm table.
func PartialStrategies(sc Scenario) []Strategy {
	p := policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: sc.Base, MaxBackoff: sc.Cap}
	return []Strategy{
		NoRetriesStrategy(),
		{Name: RetriesAlone, Policy: p},
		{Name: HerdguardDefault, Policy: p, Breaker: &breaker.Settings{}},
		{Name: BreakerOnly, Policy: p, Breaker: &breaker.Settings{}, Options: []interceptor.Option{interceptor.WithoutOverloadControl()}},
		{Name: OverloadOnly, Policy: p, Breaker: &breaker.Settings{}, Options: []interceptor.Option{interceptor.WithoutBreaker()}},
		GRPCRetryStrategy(false),
	}
}

// GRPCRetryStrategy is gRPC's built-in retry, configured by a service
// config with the scenario's attempts and waits (its own ±20 % jitter), and
// with gRFC A6's usual retry throttling (10 tokens, a ratio of 0.1) when
// throttling is true.
func GRPCRetryStrategy(throttling bool) Strategy {
	name := "gRPC built-in retry"
	if throttling {
		name += " + throttling"
	}
	return Strategy{Name: name, Peer: func(sc Scenario) []grpc.DialOption {
		return []grpc.DialOption{grpc.WithDefaultServiceConfig(GRPCRetryConfig(sc.Attempts, sc.Base, sc.Cap, throttling))}
	}}
}

// GRPCRetryConfig is a service config that has gRPC retry the demo
// gateway's and grpc's test service's methods on Unavailable: attempts in
// all, the first wait base, waits doubling up to cap, with gRFC A6's usual
// throttling when throttling is true.
func GRPCRetryConfig(attempts int, base, cap time.Duration, throttling bool) string {
	t := ""
	if throttling {
		t = `, "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}`
	}
	return fmt.Sprintf(`{"methodConfig": [{"name": [{"service": "grpc.testing.TestService"}, {"service": "herdguard.demo.v1.GatewayService"}],
	  "retryPolicy": {"maxAttempts": %d, "initialBackoff": "%.9fs", "maxBackoff": "%.9fs", "backoffMultiplier": 2,
	  "retryableStatusCodes": ["UNAVAILABLE"]}}]%s}`, attempts, base.Seconds(), cap.Seconds(), t)
}

// runClosed runs the scenario's workers in a closed loop, each making one
// call after another until sc.Duration has passed, and counts how the calls
// ended (a call refused at once comes back in microseconds, so a run can
// make millions: only counts and the successes' latencies are kept); sc is
// scaled, and the server was just reset.
func (r *Runner) runClosed(ctx context.Context, sc Scenario, res Result, clients fleet, ctl demov1.GatewayServiceClient) (Result, error) {
	type tally struct {
		outcomes          map[string]int
		latencies, failed []time.Duration
		nFailed           int
	}
	t0 := time.Now()
	end := t0.Add(sc.Duration)
	per := make([]tally, sc.Workers)
	var wg sync.WaitGroup
	for w := range sc.Workers {
		wg.Go(func() {
			t := tally{outcomes: map[string]int{}}
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for ctx.Err() == nil {
				start := time.Now()
				if !start.Before(end) {
					break
				}
				cctx, cancel := context.WithTimeout(ctx, sc.Deadline)
				_, err := clients.client(w).Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
				cancel()
				t.outcomes[outcome(err)]++
				took := time.Since(start)
				switch {
				case err == nil:
					t.latencies = append(t.latencies, took)
				case len(t.failed) < failedSample:
					t.failed = append(t.failed, took)
				default: // a uniform sample of the failed calls (Algorithm R)
					if i := rng.IntN(t.nFailed + 1); i < failedSample {
						t.failed[i] = took
					}
				}
				if err != nil {
					t.nFailed++
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
		res.FailedLatencies = append(res.FailedLatencies, t.failed...)
	}
	res.Succeeded = len(res.Latencies)
	return finishResult(ctx, res, ctl)
}

// failedSample is how many failed calls' latencies a closed loop's caller
// keeps, chosen at random among them.
const failedSample = 1000

// OKPerSecond is the calls that succeeded per second of the run's
// duration: a closed loop's throughput.
func (r Result) OKPerSecond(sc Scenario) float64 {
	return float64(r.Succeeded) / sc.Duration.Seconds()
}
