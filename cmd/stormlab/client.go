package stormlab

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	hgoverload "github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// Scenario is one experiment: a herd of calls, paced calls or steady load
// against a server with faults, all durations at full scale.
type Scenario struct {
	Name     string
	Calls    int           // calls fired at the same instant, or paced; steady load: Rate × Duration
	Attempts int           // attempts per call, the first included
	Base     time.Duration // the first wait
	Cap      time.Duration // the longest wait
	// Interval, if above 0, paces the calls: one starts every Interval (an
	// open loop, whatever the earlier ones do) instead of all at once.
	Interval time.Duration
	// Rate, if above 0, makes the scenario steady load: calls start open
	// loop, Rate per second for Duration, each on schedule whatever the
	// earlier ones do, and each with its own Deadline.
	Rate     float64
	Duration time.Duration
	Deadline time.Duration
	// Bucket is the width of the buckets a steady-load run's completions
	// are counted in (goodput, recovery); 0 means 250 ms.
	Bucket time.Duration
	// Workers, if above 0, makes the scenario a closed loop: Workers
	// callers, each making one call after another for Duration, each call
	// with its own Deadline.
	Workers int
	Faults  Faults

	herd    bool // one of the herds at a given capacity (see [Herd])
	partial bool // one of the partial failures (see [Partial])
	dead    bool // one of the dead servers (see [Dead])
}

// Published is the published experiment: 1000 calls, each attempt failing
// with probability 30 %, at most 5 attempts, a 1 s base wait, retries
// counted in 100 ms windows.
func Published() Scenario {
	return Scenario{
		Name: "independent 30% failures", Calls: 1000, Attempts: 5,
		Base: time.Second, Cap: time.Minute,
		Faults: Faults{FailRate: 0.3, Seed: 1, Window: DefaultWindow},
	}
}

// Overload is the load-dependent outage the published experiments lacked:
// the server takes at most 80 attempts per 100 ms window; more overload it,
// and it fails everything until arrivals have stayed within capacity for
// 1 s. Every window over capacity restarts that count, so the harder it is
// hit the longer it stays down, and retries that arrive together keep it
// down.
func Overload() Scenario {
	return Scenario{
		Name: "load-dependent overload", Calls: 1000, Attempts: 5,
		Base: time.Second, Cap: time.Minute,
		Faults: Faults{Capacity: 80, CapacityWindow: DefaultWindow, RecoverAfter: time.Second, Seed: 1, Window: DefaultWindow},
	}
}

// SlowAttempts is the tail-latency experiment: calls start one every
// millisecond; each attempt independently takes its normal 1 to 4 ms, but
// 1 in 100 takes 1 s (a slow replica or a pause). Nothing fails.
func SlowAttempts() Scenario {
	return Scenario{
		Name: "slow attempts", Calls: 5000, Attempts: 1, Interval: time.Millisecond,
		Faults: Faults{Latency: time.Millisecond, LatencySpread: 3 * time.Millisecond,
			SlowRate: 0.01, SlowLatency: time.Second, Seed: 1, Window: DefaultWindow},
	}
}

// HedgingStrategies are those compared in SlowAttempts: no hedging, a
// fixed hedging delay as gRFC A6 has it, and herdguard's latency-aware one
// (the method's p95, never below the default 10ms floor), each with 2
// attempts at most.
func HedgingStrategies() []Strategy {
	return []Strategy{
		{Name: "no hedging", Policy: policy.Policy{MaxAttempts: 1}},
		{Name: "hedging, fixed 20ms", Policy: policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Delay: 20 * time.Millisecond}}},
		{Name: "hedging at p95", Policy: policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Quantile: 0.95}}},
	}
}

// Strategy is herdguard's interceptor configured one way.
type Strategy struct {
	Name   string
	Policy policy.Policy
	// Breaker is the circuit breaker's settings; nil makes the strategy a
	// bare retry policy, with neither the breaker nor the overload
	// controller.
	Breaker *breaker.Settings
	// Overload is the overload controller's settings when Breaker is set
	// (zero: its defaults, as interceptor.New has them).
	Overload hgoverload.Settings
	Budget   *policy.Budget // nil: no retry budget
	// IdempotencyKey gives every call a key (WithIdempotencyKey) the server
	// dedupes charges by.
	IdempotencyKey bool
	// Options are added after those Run builds from the fields above, so
	// they can switch any feature on or off. Scale leaves them as they are.
	Options []interceptor.Option
	// Peer, if set, makes the strategy another client than herdguard's:
	// the dial options it returns for the scenario (scaled) make the
	// connection, and every field above is ignored.
	Peer func(sc Scenario) []grpc.DialOption
}

// Strategies returns the strategies compared in a scenario, in order: retry
// at once, a fixed wait, exponential without jitter, exponential with full,
// equal and decorrelated jitter, and herdguard's defaults (full jitter with
// the breaker). All are herdguard policies; "at once" and "fixed" are
// policies with multiplier 1 and, like "exponential", ask for NoJitter by
// name (a zero Jitter is full jitter).
func Strategies(sc Scenario) []Strategy {
	exp := func(j policy.Jitter) policy.Policy {
		return policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: sc.Base, MaxBackoff: sc.Cap, Multiplier: 2, Jitter: j}
	}
	return []Strategy{
		{Name: "retry at once", Policy: policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: 1, MaxBackoff: 1, Multiplier: 1, Jitter: policy.NoJitter}},
		{Name: "fixed wait", Policy: policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: sc.Base, MaxBackoff: sc.Base, Multiplier: 1, Jitter: policy.NoJitter}},
		{Name: "exponential", Policy: exp(policy.NoJitter)},
		{Name: "exponential + full jitter", Policy: exp(policy.FullJitter)},
		{Name: "exponential + equal jitter", Policy: exp(policy.EqualJitter)},
		{Name: "exponential + decorrelated", Policy: exp(policy.DecorrelatedJitter)},
		{Name: "herdguard defaults", Policy: exp(policy.FullJitter), Breaker: &breaker.Settings{}},
	}
}

// BudgetStrategy is herdguard's defaults with a retry budget (20 % of the
// calls started plus 10 per second, over 10 s).
func BudgetStrategy(sc Scenario) Strategy {
	st := Strategies(sc)[len(Strategies(sc))-1]
	st.Name, st.Budget = "herdguard + budget", &policy.Budget{}
	return st
}

// StrategiesFor returns the strategies the demo compares in a scenario: all
// of Strategies, plus the budget under the overload (a budget is sized for
// steady traffic, so it is shown where retries amplify an outage), the
// idempotency pair for lost replies, HerdStrategies for the herds,
// SteadyStrategies for steady load and PartialStrategies for the partial
// failures.
func StrategiesFor(sc Scenario) []Strategy {
	switch {
	case sc.IsSteady():
		return SteadyStrategies()
	case sc.IsHerd():
		return HerdStrategies(sc)
	case sc.IsPartial():
		return PartialStrategies(sc)
	case sc.IsDead():
		return DeadStrategies()
	}
	switch sc.Name {
	case Overload().Name:
		return append(Strategies(sc), BudgetStrategy(sc), SingleAttemptStrategy(), HedgeStrategy())
	case LostReplies().Name:
		return IdempotencyStrategies(sc)
	case SlowAttempts().Name:
		return HedgingStrategies()
	}
	return Strategies(sc)
}

// SingleAttemptStrategy sends every call once, with the breaker: the
// baseline hedging is held to under overload.
func SingleAttemptStrategy() Strategy {
	return Strategy{Name: "single attempt", Policy: policy.Policy{MaxAttempts: 1}, Breaker: &breaker.Settings{}}
}

// HedgeStrategy hedges at the method's p95 with the breaker: under
// overload it must end no worse than a single attempt.
func HedgeStrategy() Strategy {
	return Strategy{Name: "hedging at p95", Policy: HedgingStrategies()[2].Policy, Breaker: &breaker.Settings{}}
}

// LostReplies is the idempotency experiment: every charge is applied, then
// 20 % of replies are lost, so the caller retries a charge the server
// already took. Without an idempotency key each such retry charges again.
func LostReplies() Scenario {
	return Scenario{
		Name: "lost replies", Calls: 1000, Attempts: 5, Base: time.Second, Cap: time.Minute,
		Faults: Faults{LostReplyRate: 0.2, Seed: 1, Window: DefaultWindow},
	}
}

// IdempotencyStrategies are herdguard's defaults without and with an
// idempotency key per call.
func IdempotencyStrategies(sc Scenario) []Strategy {
	p := policy.Policy{MaxAttempts: sc.Attempts, InitialBackoff: sc.Base, MaxBackoff: sc.Cap, Multiplier: 2, Jitter: policy.FullJitter}
	return []Strategy{
		{Name: "herdguard, no idempotency key", Policy: p, Breaker: &breaker.Settings{}},
		{Name: "herdguard + idempotency key", Policy: p, Breaker: &breaker.Settings{}, IdempotencyKey: true},
	}
}

// Scale divides every duration of the scenario by s (s ≥ 1 shortens it)
// and multiplies a steady load's Rate by s, so that as many calls arrive
// per (shorter) window.
func (sc Scenario) Scale(s float64) Scenario {
	sc.Base, sc.Cap = scaleDur(sc.Base, s), scaleDur(sc.Cap, s)
	if (sc.Rate > 0 || sc.Workers > 0) && s > 0 {
		sc.Rate *= s
		sc.Duration = scaleDur(sc.Duration, s)
		sc.Bucket = scaleDur(sc.bucket(), s)
	}
	sc.Deadline = scaleDur(sc.Deadline, s)
	f := &sc.Faults
	f.Outage, f.CapacityWindow, f.RecoverAfter, f.Window = scaleDur(f.Outage, s), scaleDur(f.CapacityWindow, s), scaleDur(f.RecoverAfter, s), scaleDur(f.Window, s)
	f.QueueLimit, f.TriggerFor = scaleDur(f.QueueLimit, s), scaleDur(f.TriggerFor, s)
	if f.TriggerAt > 0 && s > 0 {
		f.TriggerAt = time.Duration(float64(f.TriggerAt) / s) // may be shorter than a millisecond, as it may be 0
	}
	// A paced run keeps its pace and its normal latencies (below a
	// millisecond they would be lost in the machine's own noise); only its
	// slow attempts get shorter.
	f.SlowLatency = scaleDur(f.SlowLatency, s)
	return sc
}

// Scale divides every duration of the strategy by s.
func (st Strategy) Scale(s float64) Strategy {
	p := &st.Policy
	if p.InitialBackoff > 1 {
		p.InitialBackoff = scaleDur(p.InitialBackoff, s)
	}
	if p.MaxBackoff > 1 {
		p.MaxBackoff = scaleDur(p.MaxBackoff, s)
	}
	if st.Breaker != nil {
		b := st.Breaker.WithDefaults()
		b.OpenTimeout, b.MaxOpenTimeout, b.Window = scaleDur(b.OpenTimeout, s), scaleDur(b.MaxOpenTimeout, s), scaleDur(b.Window, s)
		st.Breaker = &b
		o := &st.Overload
		o.Interval, o.Hold = scaleDur(cmp.Or(o.Interval, hgoverload.DefaultInterval), s), scaleDur(cmp.Or(o.Hold, hgoverload.DefaultHold), s)
	}
	if st.Budget != nil {
		b := st.Budget.WithDefaults()
		b.Window = max(scaleDur(b.Window, s), 10*time.Millisecond)
		b.MinPerSecond *= s // the same reserve of retries per (shorter) window
		st.Budget = &b
	}
	return st
}

func scaleDur(d time.Duration, s float64) time.Duration {
	if d <= 0 || s <= 0 {
		return d
	}
	return max(time.Duration(float64(d)/s), time.Millisecond)
}

// Result is what one strategy did in one scenario. The server's counts are
// in Stats; the client counts only what the server cannot see.
type Result struct {
	Scenario  string
	Strategy  string
	Calls     int
	Succeeded int // calls that succeeded
	Failed    int // calls that failed, breaker refusals included
	FastFails int // calls the breaker refused without sending
	// BudgetRefusals counts calls whose retry the budget refused.
	BudgetRefusals int
	// AfterRecovery and AfterRecoveryOK count a second, smaller herd sent
	// once an overloaded server had recovered (0 when none was sent), and
	// how many of its calls succeeded.
	AfterRecovery, AfterRecoveryOK int
	// Outcomes counts the calls by how they ended: herdguard's outcome
	// (ok, exhausted, breaker_open, ...) or, for an error herdguard passed
	// on as it was, the status code.
	Outcomes map[string]int
	Elapsed  time.Duration
	Stats    *demov1.GetStatsResponse
	// Latencies are the successful calls' latencies, as the client saw
	// them, in order (paced and steady runs only).
	Latencies []time.Duration
	// FailedLatencies are the failed calls' latencies, in order (steady
	// runs, and closed loops, where they are a sample of up to
	// failedSample per caller).
	FailedLatencies []time.Duration
	// Steady is what the client recorded of each call of a steady load;
	// nil for other scenarios.
	Steady *Steady
}

// AttemptsPerCall is the attempts the server received per call started.
func (r Result) AttemptsPerCall() float64 {
	return float64(r.Stats.GetAttempts()) / float64(max(r.Calls, 1))
}

// Percentile returns the q quantile (nearest rank) of the successful
// calls' latencies, or 0 when there are none.
func (r Result) Percentile(q float64) time.Duration {
	n := len(r.Latencies)
	if n == 0 {
		return 0
	}
	k := int(math.Ceil(q*float64(n))) - 1
	return r.Latencies[min(max(k, 0), n-1)]
}

// Runner fires scenarios at a demo server.
type Runner struct {
	Addr string // the server, host:port on loopback
	// ControlAddr, if set, is the server the resets and counts go to
	// (ResetStats, GetStats) when the calls go to Addr: the leaf of a
	// chain of tiers whose gateway is Addr.
	ControlAddr    string
	TracerProvider trace.TracerProvider // nil: the global provider
	// DialOptions are added to the connection the calls go through, after
	// the client's own (for instance [ClientTracing]).
	DialOptions []grpc.DialOption
	// OnProgress, if set, is called when a run starts and ends.
	OnProgress func(scenario, strategy string, done bool)
	// Clients is how many clients send the scenario's calls, as the
	// replicas of a service do: each with a connection of its own and,
	// for herdguard's strategies, an interceptor of its own; the calls
	// are dealt out to them in turn (a closed loop's callers, too). 0 or
	// 1 is one client.
	Clients int
}

// clients is how many clients a run has.
func (r *Runner) clients() int { return max(r.Clients, 1) }

// Run resets the server to the scenario's faults, fires the scenario's
// calls (at once, paced, or as steady load) through an interceptor
// configured as st, waits for all of them, and returns what the server and
// the client counted. sc and st are
// at full scale; every duration of both is divided by scale.
func (r *Runner) Run(ctx context.Context, sc Scenario, st Strategy, scale float64) (Result, error) {
	sc, st = sc.Scale(scale), st.Scale(scale)
	if st.Peer != nil {
		return r.RunClient(ctx, sc, st.Name, st.Peer(sc), nil)
	}
	var groups []*breaker.Group
	return r.RunFleet(ctx, sc, st.Name, func() ([]grpc.DialOption, error) {
		ic, err := st.interceptor(r.TracerProvider)
		if err != nil {
			return nil, err
		}
		groups = append(groups, ic.Breakers())
		return ic.DialOptions(), nil
	}, func() []*breaker.Group { return groups })
}

// interceptor returns herdguard's interceptor configured as st (already
// scaled; st.Peer is not looked at), tracing through tp.
func (st Strategy) interceptor(tp trace.TracerProvider) (*interceptor.Interceptor, error) {
	opts := []interceptor.Option{interceptor.WithPolicy(st.Policy), interceptor.WithTracerProvider(tp)}
	if st.Breaker != nil {
		opts = append(opts, interceptor.WithBreaker(*st.Breaker), interceptor.WithOverloadControl(st.Overload))
	} else {
		opts = append(opts, interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl())
	}
	if st.Budget != nil {
		opts = append(opts, interceptor.WithRetryBudget(*st.Budget))
	}
	if st.IdempotencyKey {
		opts = append(opts, interceptor.WithIdempotencyKey(IdempotencyKeyMetadata))
	}
	opts = append(opts, st.Options...)
	ic, err := interceptor.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("strategy %q: %w", st.Name, err)
	}
	return ic, nil
}

// RunClient is Run for any client: it fires the scenario (already scaled)
// through connections made with dial, for instance another retry library's
// interceptor (one per client, all with the same options), and reports as
// Run does. breakers, if not nil, are the client's herdguard breakers,
// waited for before the calls made after recovery.
func (r *Runner) RunClient(ctx context.Context, sc Scenario, name string, dial []grpc.DialOption, breakers *breaker.Group) (Result, error) {
	var groups []*breaker.Group
	if breakers != nil {
		groups = []*breaker.Group{breakers}
	}
	return r.RunFleet(ctx, sc, name, func() ([]grpc.DialOption, error) { return dial, nil },
		func() []*breaker.Group { return groups })
}

// RunFleet is RunClient for r.Clients clients, each connected with the
// options dial returns when called for it (herdguard's interceptor must be
// one per client). breakers, if not nil, returns the clients' herdguard
// breakers once they are made.
func (r *Runner) RunFleet(ctx context.Context, sc Scenario, name string, dial func() ([]grpc.DialOption, error), breakers func() []*breaker.Group) (Result, error) {
	res := Result{Scenario: sc.Name, Strategy: name, Calls: sc.Calls}
	control, err := grpc.NewClient(cmp.Or(r.ControlAddr, r.Addr), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return res, err
	}
	defer control.Close()
	ctl := demov1.NewGatewayServiceClient(control)

	var clients fleet
	for range r.clients() {
		opts, err := dial()
		if err != nil {
			return res, err
		}
		opts = append(append(opts[:len(opts):len(opts)], r.DialOptions...), grpc.WithTransportCredentials(insecure.NewCredentials()))
		cc, err := grpc.NewClient(r.Addr, opts...)
		if err != nil {
			return res, err
		}
		defer cc.Close()
		waitReady(ctx, cc)
		clients = append(clients, demov1.NewGatewayServiceClient(cc))
	}
	client := clients[0]

	if r.OnProgress != nil {
		r.OnProgress(sc.Name, name, false)
		defer r.OnProgress(sc.Name, name, true)
	}
	if _, err := ctl.ResetStats(ctx, &demov1.ResetStatsRequest{Faults: sc.Faults.Proto()}); err != nil {
		return res, fmt.Errorf("reset the server: %w", err)
	}
	// The server's clock starts at the first attempt it counts, so the herd
	// opens its first window and each wave of retries keeps that offset.
	switch {
	case sc.Rate > 0:
		return r.runSteady(ctx, sc, res, clients, ctl)
	case sc.Workers > 0:
		return r.runClosed(ctx, sc, res, clients, ctl)
	}

	// A generous bound per call: no call of a scenario needs longer than all
	// its waits at their cap.
	callTimeout := time.Duration(sc.Attempts)*sc.Cap + 10*time.Second
	if sc.Deadline > 0 {
		callTimeout = sc.Deadline
	}
	began := time.Now()
	var h herd
	if sc.Interval > 0 {
		h = firePaced(ctx, clients, sc.Calls, sc.Interval, callTimeout)
		res.Latencies = h.latencies
		slices.Sort(res.Latencies)
	} else {
		h = fireHerd(ctx, clients, sc.Calls, callTimeout)
	}
	res.Elapsed = time.Since(began)
	res.Succeeded, res.FastFails, res.Outcomes = h.ok, h.outcomes[string(interceptor.OutcomeBreakerOpen)], h.outcomes
	res.BudgetRefusals = h.outcomes[string(interceptor.OutcomeBudgetExhausted)]
	res.Failed = sc.Calls - h.ok

	if sc.Faults.Capacity > 0 {
		// Let an overloaded server recover before reading its counts, so
		// that its recovery time is known for every strategy.
		r.waitRecovered(ctx, ctl, sc.Faults.withDefaults().RecoverAfter*10)
	}
	res.Stats, err = ctl.GetStats(ctx, &demov1.GetStatsRequest{})
	if err != nil {
		return res, fmt.Errorf("read the server's counts: %w", err)
	}
	if sc.Faults.Capacity > 0 && !res.Stats.GetOverloaded() {
		// Every call made once the server has recovered should get through.
		// The client's breaker may still be open: wait until it lets a
		// probe through, as a caller would retry later, then make the calls
		// one after another.
		if breakers != nil {
			for _, g := range breakers() {
				if g == nil { // a strategy without a breaker
					continue
				}
				g.Each(func(b *breaker.Breaker) {
					for b.State() == breaker.Open && ctx.Err() == nil {
						wait(ctx, 5*time.Millisecond)
					}
				})
			}
		}
		res.AfterRecovery = max(sc.Faults.Capacity/2, 1)
		for range res.AfterRecovery {
			cctx, cancel := context.WithTimeout(ctx, callTimeout)
			if _, err := client.Charge(cctx, &demov1.ChargeRequest{AmountCents: 100}); err == nil {
				res.AfterRecoveryOK++
			}
			cancel()
		}
	}
	return res, ctx.Err()
}

// herd is what the client counted of a herd of calls.
type herd struct {
	ok        int
	outcomes  map[string]int
	latencies []time.Duration // of the successful calls
}

// fleet is the clients of a run; call i goes to client i mod their number.
type fleet []demov1.GatewayServiceClient

func (f fleet) client(i int) demov1.GatewayServiceClient { return f[i%len(f)] }

// firePaced starts n charges, one every interval, and waits for all of
// them, timing each.
func firePaced(ctx context.Context, clients fleet, n int, interval, timeout time.Duration) herd {
	var (
		mu sync.Mutex
		wg sync.WaitGroup
		h  = herd{outcomes: map[string]int{}}
	)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for i := range n {
		if i > 0 {
			select {
			case <-tick.C:
			case <-ctx.Done():
			}
		}
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			start := time.Now()
			_, err := clients.client(i).Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
			took := time.Since(start)
			mu.Lock()
			defer mu.Unlock()
			h.outcomes[outcome(err)]++
			if err == nil {
				h.ok++
				h.latencies = append(h.latencies, took)
			}
		})
	}
	wg.Wait()
	return h
}

// fireHerd starts n charges at the same instant and waits for all of them.
func fireHerd(ctx context.Context, clients fleet, n int, timeout time.Duration) herd {
	var (
		mu    sync.Mutex
		wg    sync.WaitGroup
		start = make(chan struct{})
		h     = herd{outcomes: map[string]int{}}
	)
	for i := range n {
		wg.Go(func() {
			<-start
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			_, err := clients.client(i).Charge(cctx, &demov1.ChargeRequest{AmountCents: 100})
			mu.Lock()
			defer mu.Unlock()
			h.outcomes[outcome(err)]++
			if err == nil {
				h.ok++
			}
		})
	}
	close(start)
	wg.Wait()
	return h
}

// waitReady connects cc and waits until it is ready (or ctx ends), so that
// the first calls do not wait for the connection.
func waitReady(ctx context.Context, cc *grpc.ClientConn) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cc.Connect()
	for st := cc.GetState(); st != connectivity.Ready; st = cc.GetState() {
		if !cc.WaitForStateChange(ctx, st) {
			return
		}
	}
}

// waitRecovered polls the server until it is no longer overloaded, for at
// most limit.
func (r *Runner) waitRecovered(ctx context.Context, ctl demov1.GatewayServiceClient, limit time.Duration) {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		st, err := ctl.GetStats(ctx, &demov1.GetStatsRequest{})
		if err != nil || !st.GetOverloaded() {
			return
		}
		wait(ctx, 5*time.Millisecond)
	}
}

// outcome names how a call ended, from its error.
func outcome(err error) string {
	var re *interceptor.RetryError
	switch {
	case err == nil:
		return string(interceptor.OutcomeOK)
	case errors.As(err, &re):
		return string(re.Outcome)
	case errors.Is(err, breaker.ErrOpen):
		return string(interceptor.OutcomeBreakerOpen)
	}
	return "error " + status.Code(err).String()
}

func wait(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// namedScenarios are the short names ScenariosNamed knows, in the order
// ScenarioNames lists them.
var namedScenarios = []struct {
	name string
	scs  func() []Scenario
}{
	{"published", func() []Scenario { return []Scenario{Published()} }},
	{"overload", func() []Scenario { return []Scenario{Overload()} }},
	{"lost-replies", func() []Scenario { return []Scenario{LostReplies()} }},
	{"slow", func() []Scenario { return []Scenario{SlowAttempts()} }},
	{"all", func() []Scenario { return []Scenario{Published(), Overload(), LostReplies(), SlowAttempts()} }},
	{"herd-20", func() []Scenario { return []Scenario{Herd(20)} }},
	{"herd-80", func() []Scenario { return []Scenario{Herd(80)} }},
	{"herd-320", func() []Scenario { return []Scenario{Herd(320)} }},
	{"herds", Herds},
	{"steady-cut", func() []Scenario { return []Scenario{SteadyCut()} }},
	{"steady-outage", func() []Scenario { return []Scenario{SteadyOutage()} }},
	{"steady-gentle", func() []Scenario { return []Scenario{SteadyGentle()} }},
	{"steady", SteadyScenarios},
	{"herds-deadline", HerdsDeadline},
	{"partial-open", PartialOpen},
	{"partial-closed", PartialClosed},
	{"partial-short", PartialShort},
	{"partial", PartialScenarios},
	{"dead-refusing", func() []Scenario { return []Scenario{Dead(false, true)} }},
	{"dead-killed", func() []Scenario { return []Scenario{Dead(true, true)} }},
	{"dead-refusing-nodeadline", func() []Scenario { return []Scenario{Dead(false, false)} }},
	{"dead-killed-nodeadline", func() []Scenario { return []Scenario{Dead(true, false)} }},
	{"dead", DeadScenarios},
}

// ScenarioNames lists the names ScenariosNamed knows, for a command's
// help: "published", "overload", ... or "steady".
func ScenarioNames() string {
	var b strings.Builder
	for i, n := range namedScenarios {
		switch {
		case i == len(namedScenarios)-1:
			b.WriteString(" or ")
		case i > 0:
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%q", n.name)
	}
	return b.String()
}

// ScenariosNamed returns the scenarios a short name stands for (one of
// ScenarioNames: "herd-80", "steady-gentle", "herds", ...), and whether the
// name is known.
func ScenariosNamed(name string) ([]Scenario, bool) {
	for _, n := range namedScenarios {
		if n.name == name {
			return n.scs(), true
		}
	}
	return nil, false
}
