package redisfleet_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/redistest"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/redisfleet"
)

const scope = "dns:///payments.internal:443"

// client returns a go-redis client configured as the package documents.
func client(t testing.TB, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true,
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond, WriteTimeout: 100 * time.Millisecond,
		MaxRetries: -1})
	t.Cleanup(func() { c.Close() })
	return c
}

// replica is one process of the fleet: its own client, fleet and breaker.
type replica struct {
	fleet *redisfleet.Fleet
	b     *breaker.Breaker
	log   *syncBuffer
	rec   *sdkmetric.ManualReader
}

func newReplica(t testing.TB, addr string, s breaker.Settings, opts redisfleet.Options) *replica {
	t.Helper()
	r := &replica{log: &syncBuffer{}, rec: sdkmetric.NewManualReader()}
	opts.Client = client(t, addr)
	if opts.Timeout == 0 {
		// wide: under the race detector a script can take longer than the
		// default 50 ms, which would count as Redis lost; the tests of the
		// bound set their own
		opts.Timeout = 500 * time.Millisecond
	}
	opts.Logger = slog.New(slog.NewTextHandler(r.log, nil))
	opts.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.rec))
	f, err := redisfleet.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	r.fleet = f
	s.Fleet = f
	if r.b, err = breaker.New(scope, s); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := f.WaitSynced(ctx); err != nil {
		t.Fatalf("the fleet did not sync: %v", err)
	}
	testutil.Eventually(t, "the breaker follows the fleet", r.b.Shared)
	return r
}

// call makes one call through the replica's breaker that ends with v.
func (r *replica) call(v herdguard.Verdict) (ran bool, err error) {
	_, _, err = r.b.Execute(func(bool) herdguard.Verdict { ran = true; return v })
	return ran, err
}

func (r *replica) counter(t testing.TB, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.rec.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				if s, ok := m.Data.(metricdata.Sum[int64]); ok {
					var n int64
					for _, p := range s.DataPoints {
						n += p.Value
					}
					return n
				}
				if g, ok := m.Data.(metricdata.Gauge[int64]); ok && len(g.DataPoints) == 1 {
					return g.DataPoints[0].Value
				}
			}
		}
	}
	return 0
}

func fleetState(r *replica) breaker.State {
	s, _ := r.b.FleetState()
	return s
}

func refusedShared(err error) bool {
	var oe *breaker.OpenError
	return errors.As(err, &oe) && oe.Shared
}

func TestOptionsAreChecked(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for _, tt := range []struct {
		opts redisfleet.Options
		want string
	}{
		{redisfleet.Options{}, "Options.Client"},
		{redisfleet.Options{Client: c, Timeout: -1}, "Options.Timeout = -1ns"},
		{redisfleet.Options{Client: c, TTL: -time.Second}, "Options.TTL = -1s"},
		{redisfleet.Options{Client: c, Queue: -3}, "Options.Queue = -3"},
	} {
		if _, err := redisfleet.New(tt.opts); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("New(%+v) = %v, want an error naming %s", tt.opts, err, tt.want)
		}
	}
}

func TestFleetOpensTogether(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Hour}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})

	// failures of both replicas count in one run
	a.call(herdguard.Failure)
	a.call(herdguard.Failure)
	testutil.Eventually(t, "the other replica hears the fleet is suspect", func() bool {
		return b.b.Shared() && fleetState(b) == breaker.Closed
	})
	if ran, err := b.call(herdguard.Failure); !ran || err != nil {
		t.Fatalf("the third failure was refused: %v", err)
	}
	// A replica tells Redis of its calls without waiting: until b's
	// failure is counted there, a success of a's could still end the run
	// first, and the fleet would rightly stay closed.
	testutil.Eventually(t, "Redis opens the fleet on the third failure", func() bool {
		return client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "st").Val() == "o"
	})
	took := testutil.Eventually(t, "replica a refuses after b's failure opened the fleet", func() bool {
		_, err := a.call(herdguard.Success)
		return refusedShared(err)
	})
	t.Logf("replica a refused %v after b's third failure", took)
	testutil.Eventually(t, "replica b refuses too", func() bool {
		_, err := b.call(herdguard.Success)
		return refusedShared(err)
	})
	// neither replica's own breaker opened: the fleet did
	if a.b.State() != breaker.Closed || b.b.State() != breaker.Closed {
		t.Errorf("own breakers %v and %v, want both closed", a.b.State(), b.b.State())
	}
}

// With the default rule (no ConsecutiveFailures), a fleet's run of
// failed calls opens the shared breaker only once it has lasted DownAfter
// from its first failure: many failures in a row in a moment, as a
// server that fails a share of its calls on its own makes now and then,
// leave it closed. Redis times the run, on its own clock.
func TestFleetRunMustLastDownAfter(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{DownAfter: 500 * time.Millisecond, OpenTimeout: time.Hour}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})
	began := time.Now()
	for range 10 {
		a.call(herdguard.Failure)
		b.call(herdguard.Failure)
	}
	testutil.Eventually(t, "Redis counts 20 failures", func() bool { return failures(t, srv.Addr) == 20 })
	if time.Since(began) < 400*time.Millisecond { // else the machine was too slow to tell
		if st := client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "st").Val(); st == "o" {
			t.Errorf("20 failures in %v opened the fleet, before DownAfter", time.Since(began))
		}
	}
	time.Sleep(time.Until(began.Add(600 * time.Millisecond)))
	// a's own breaker, with the same rule, opens on this failure too: the
	// fleet's must have opened as well
	a.call(herdguard.Failure)
	// Counted first: a success of b's told Redis before a's failure would
	// end the run (see TestFleetOpensTogether).
	testutil.Eventually(t, "Redis opens the fleet once the run lasted DownAfter", func() bool {
		return client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "st").Val() == "o"
	})
	testutil.Eventually(t, "b hears the fleet opened", func() bool {
		_, err := b.call(herdguard.Success)
		return refusedShared(err)
	})
}

func TestASuccessEndsTheFleetRun(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Hour}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})
	a.call(herdguard.Failure)
	a.call(herdguard.Failure)
	testutil.Eventually(t, "Redis counts 2 failures", func() bool { return failures(t, srv.Addr) == 2 })
	// b's success, once b heard the fleet is suspect, ends the run
	testutil.Eventually(t, "b's success ends the fleet's run of failures", func() bool {
		b.call(herdguard.Success)
		return failures(t, srv.Addr) == 0
	})
	a.call(herdguard.Failure) // a's own run is 3 now: its own breaker opened
	b.call(herdguard.Failure)
	testutil.Eventually(t, "Redis counts 2 new failures", func() bool { return failures(t, srv.Addr) == 2 })
	if st := client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "st").Val(); st == "o" {
		t.Error("2 failures after a success opened the fleet")
	}
}

// failures returns the fleet's run of failed calls, as Redis counts it.
func failures(t testing.TB, addr string) int {
	n, _ := client(t, addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "f").Int()
	return n
}

// suspect reports whether the scope's hash counts failures.
func suspect(t testing.TB, addr string) bool { return failures(t, addr) > 0 }

func TestOneProbeAcrossTheFleet(t *testing.T) {
	// Fixed open periods, as the fleet's shared breaker keeps them: a
	// replica's own breaker would otherwise double its period after the
	// failed probe and refuse round 1 by itself.
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 300 * time.Millisecond, MaxOpenTimeout: 300 * time.Millisecond}
	var fleet []*replica
	for range 6 {
		fleet = append(fleet, newReplica(t, srv.Addr, s, redisfleet.Options{}))
	}
	fleet[0].call(herdguard.Failure) // opens the fleet; in round 1, the failed probe of round 0 has
	for round := range 2 {
		for _, r := range fleet {
			testutil.Eventually(t, "every replica hears the fleet opened", func() bool { return fleetState(r) != breaker.Closed })
		}
		time.Sleep(350 * time.Millisecond) // the open period ends

		release := make(chan struct{})
		var probes, refused atomic.Int32
		var wg sync.WaitGroup
		for _, r := range fleet {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _, err := r.b.Execute(func(probe bool) herdguard.Verdict {
					if probe {
						probes.Add(1)
					}
					<-release
					if round == 0 {
						return herdguard.Failure // the probe fails: open again
					}
					return herdguard.Success
				})
				if refusedShared(err) {
					refused.Add(1)
				}
			}()
		}
		testutil.Eventually(t, "five replicas are refused", func() bool { return refused.Load() == 5 })
		close(release)
		wg.Wait()
		if probes.Load() != 1 {
			t.Fatalf("round %d: %d probes across the fleet, want 1", round, probes.Load())
		}
		if round == 0 {
			for _, r := range fleet {
				testutil.Eventually(t, "the failed probe opens the fleet again", func() bool { return fleetState(r) == breaker.Open })
			}
		}
	}
	for _, r := range fleet {
		testutil.Eventually(t, "the probe's success closes the fleet", func() bool { return fleetState(r) == breaker.Closed })
		if ran, err := r.call(herdguard.Success); !ran || err != nil {
			t.Errorf("after the fleet closed: ran %v, %v", ran, err)
		}
	}
	var leases int64
	for _, r := range fleet {
		leases += r.counter(t, redisfleet.MetricProbes)
	}
	if leases != 2 {
		t.Errorf("the replicas counted %d leases in two open periods, want 2", leases)
	}
}

func TestAProbeLeaseLapses(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 200 * time.Millisecond, MaxOpenTimeout: 200 * time.Millisecond}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})
	a.call(herdguard.Failure)
	testutil.Eventually(t, "b hears", func() bool { return fleetState(b) != breaker.Closed })
	time.Sleep(250 * time.Millisecond)
	// a takes the lease and never reports, as a replica that died would
	blocked, leased := make(chan struct{}), make(chan bool)
	go a.b.Execute(func(probe bool) herdguard.Verdict { leased <- probe; <-blocked; return herdguard.Ignored })
	defer close(blocked)
	if !<-leased {
		t.Fatal("a's call did not run as the fleet's probe")
	}
	testutil.Eventually(t, "b is refused while a's lease lasts", func() bool {
		_, err := b.call(herdguard.Success)
		return refusedShared(err)
	})
	testutil.Eventually(t, "b gets a probe once the lease lapses (one open period)", func() bool {
		ran, _ := b.call(herdguard.Success)
		return ran
	})
}

// TestALapsedLeaseCountsForNothing: a probe still running when its lease
// lapsed (after OpenTimeout) no longer decides: the round of the replica
// probing since does.
func TestALapsedLeaseCountsForNothing(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 200 * time.Millisecond, MaxOpenTimeout: 200 * time.Millisecond}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})
	a.call(herdguard.Failure)
	testutil.Eventually(t, "b hears the fleet opened", func() bool { return fleetState(b) != breaker.Closed })
	time.Sleep(250 * time.Millisecond) // the open period ends
	release, leased := make(chan struct{}), make(chan bool)
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.b.Execute(func(probe bool) herdguard.Verdict { leased <- probe; <-release; return herdguard.Failure })
	}()
	if !<-leased {
		t.Fatal("a's call was not the fleet's probe")
	}
	// a's lease lapses; b probes in a new round and succeeds
	testutil.Eventually(t, "b probes once a's lease lapsed", func() bool {
		ran, _ := b.call(herdguard.Success)
		return ran
	})
	for _, r := range []*replica{a, b} {
		testutil.Eventually(t, "b's success closes the fleet", func() bool { return fleetState(r) == breaker.Closed })
	}
	close(release) // a's late failure comes in
	<-done
	redisfleet.Flush(a.fleet) // a's late verdict reached Redis
	if st := client(t, srv.Addr).HGet(context.Background(), redisfleet.DefaultPrefix+scope, "st").Val(); st == "o" {
		t.Error("a probe's verdict after its lease lapsed opened the fleet again")
	}
}

func TestRedisKilledFallsBackAndRejoins(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Hour}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{})
	b := newReplica(t, srv.Addr, s, redisfleet.Options{})

	srv.Kill()
	// no call fails or waits because Redis is gone
	for i := range 200 {
		began := time.Now()
		ran, err := a.call(herdguard.Success)
		if !ran || err != nil {
			t.Fatalf("call %d with Redis gone: ran %v, %v", i, ran, err)
		}
		if d := time.Since(began); d > 20*time.Millisecond {
			t.Fatalf("call %d waited %v", i, d)
		}
	}
	began := time.Now()
	a.call(herdguard.Failure) // queued for the worker: the caller does not wait
	if d := time.Since(began); d > 20*time.Millisecond {
		t.Errorf("a failure with Redis gone waited %v", d)
	}
	testutil.Eventually(t, "both replicas fall back to their own breakers", func() bool { return !a.b.Shared() && !b.b.Shared() })
	// each replica's own breaker decides
	a.call(herdguard.Failure)
	a.call(herdguard.Failure)
	if ran, err := a.call(herdguard.Success); ran || err == nil || refusedShared(err) {
		t.Errorf("with Redis gone, a's own breaker after 3 failures: ran %v, %v; want its own refusal", ran, err)
	}
	for range 20 {
		a.call(herdguard.Failure)
	}
	testutil.Eventually(t, "the loss is counted", func() bool { return a.counter(t, redisfleet.MetricLost) == 1 })
	if n := strings.Count(a.log.String(), "cannot be reached"); n != 1 {
		t.Errorf("the loss was logged %d times, want once:\n%s", n, a.log.String())
	}
	if v := a.counter(t, redisfleet.MetricReachable); v != 0 {
		t.Errorf("reachable = %d while Redis is gone", v)
	}

	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	took := testutil.Eventually(t, "both replicas rejoin the fleet", func() bool { return a.b.Shared() && b.b.Shared() })
	t.Logf("rejoined %v after Redis restarted", took)
	// The return is logged once the fleet's lock is released, after the
	// views follow Redis again.
	testutil.Eventually(t, "the return is logged", func() bool { return strings.Contains(a.log.String(), "answers again") })
	if v := a.counter(t, redisfleet.MetricReachable); v != 1 {
		t.Errorf("reachable = %d after Redis returned", v)
	}
	// the fleet works again: b's failures open it for a too
	for range 3 {
		b.call(herdguard.Failure)
	}
	testutil.Eventually(t, "the fleet opens again", func() bool { return fleetState(a) == breaker.Open })
}

func TestSlowRedisNeverHoldsACall(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 100 * time.Millisecond, MaxOpenTimeout: 100 * time.Millisecond}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{Timeout: 50 * time.Millisecond})
	a.call(herdguard.Failure)
	testutil.Eventually(t, "the fleet opens", func() bool { return fleetState(a) == breaker.Open })
	time.Sleep(150 * time.Millisecond) // the open period ends: the next call asks Redis for a lease
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	defer srv.Resume()
	began := time.Now()
	ran, err := a.call(herdguard.Success)
	d := time.Since(began)
	if !ran || err != nil {
		t.Errorf("with Redis hung, the call: ran %v, %v; want it sent on the replica's own breaker", ran, err)
	}
	if d > 250*time.Millisecond { // the bound is one 50 ms round trip; a margin for a loaded machine
		t.Errorf("the call waited %v for a hung Redis", d)
	}
	if a.b.Shared() {
		t.Error("the breaker still follows a hung Redis")
	}
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the replica rejoins once Redis answers", a.b.Shared)
}

func TestStateOfADeadReplicaExpires(t *testing.T) {
	srv := redistest.Start(t)
	s := breaker.Settings{ConsecutiveFailures: 5, OpenTimeout: 100 * time.Millisecond, MaxOpenTimeout: 100 * time.Millisecond}
	a := newReplica(t, srv.Addr, s, redisfleet.Options{TTL: 300 * time.Millisecond})
	a.call(herdguard.Failure)
	testutil.Eventually(t, "the failure is counted", func() bool { return suspect(t, srv.Addr) })
	a.fleet.Close() // the replica dies
	testutil.Eventually(t, "its state expires", func() bool {
		n, err := client(t, srv.Addr).Exists(context.Background(), redisfleet.DefaultPrefix+scope).Result()
		return err == nil && n == 0
	})
}

// TestCalmCallsMakeNoRoundTrip counts the commands Redis processed while a
// replica made 1000 healthy calls and one failed call.
func TestCalmCallsMakeNoRoundTrip(t *testing.T) {
	srv := redistest.Start(t)
	a := newReplica(t, srv.Addr, breaker.Settings{}, redisfleet.Options{})
	before := commands(t, srv.Addr)
	for range 1000 {
		a.call(herdguard.Success)
	}
	a.call(herdguard.Failure)
	testutil.Eventually(t, "the failure reaches Redis", func() bool { return suspect(t, srv.Addr) })
	// the failure's script, the recovery after it, this test's own reads and
	// INFO, and a ping or two of the subscriber's health check
	if n := commands(t, srv.Addr) - before; n > 20 {
		t.Errorf("Redis processed %d commands for 1000 healthy calls and 1 failure", n)
	}
	if n := testing.AllocsPerRun(100, func() { a.call(herdguard.Success) }); n != 0 {
		t.Errorf("a healthy call on a shared breaker allocates %v times", n)
	}
}

func commands(t testing.TB, addr string) int {
	t.Helper()
	info, err := client(t, addr).Info(context.Background(), "stats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "total_commands_processed:"); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Fatal("INFO stats has no total_commands_processed")
	return 0
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestStateMadeAgainAfterExpiry: a scope's hash that expired after the
// fleet opened and closed is made again by the next failure, in a newer
// generation than the replicas saw, so they follow it: a success still
// ends the fleet's run of failures. And a replica that saw the fleet open
// when its hash expired finds it calm at its next probe, instead of
// asking Redis for a probe on every call from then on.
func TestStateMadeAgainAfterExpiry(t *testing.T) {
	ctx := context.Background()
	key := redisfleet.DefaultPrefix + scope
	gone := func(t *testing.T, addr string) func() bool {
		return func() bool {
			n, err := client(t, addr).Exists(ctx, key).Result()
			return err == nil && n == 0
		}
	}
	t.Run("closed", func(t *testing.T) {
		srv := redistest.Start(t)
		s := breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: 100 * time.Millisecond, MaxOpenTimeout: 100 * time.Millisecond}
		a := newReplica(t, srv.Addr, s, redisfleet.Options{TTL: 300 * time.Millisecond})
		for range 3 {
			a.call(herdguard.Failure)
		}
		testutil.Eventually(t, "the fleet opens", func() bool { return fleetState(a) == breaker.Open })
		testutil.Eventually(t, "a probe closes it", func() bool {
			a.call(herdguard.Success)
			return fleetState(a) == breaker.Closed && a.b.State() == breaker.Closed
		})
		testutil.Eventually(t, "the hash expires", gone(t, srv.Addr))
		for i := range 3 { // a failure and a success, three times: never 3 in a row
			a.call(herdguard.Failure)
			redisfleet.Flush(a.fleet)
			if ran, err := a.call(herdguard.Success); !ran || err != nil {
				t.Fatalf("success %d refused: %v (Redis counts %d failures)", i+1, err, failures(t, srv.Addr))
			}
			redisfleet.Flush(a.fleet)
		}
		if n := failures(t, srv.Addr); n != 0 {
			t.Errorf("Redis counts %d failures in a row after a success", n)
		}
	})
	t.Run("open", func(t *testing.T) {
		srv := redistest.Start(t)
		s := breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 100 * time.Millisecond, MaxOpenTimeout: 100 * time.Millisecond}
		a := newReplica(t, srv.Addr, s, redisfleet.Options{TTL: 300 * time.Millisecond})
		a.call(herdguard.Failure)
		testutil.Eventually(t, "the fleet opens", func() bool { return fleetState(a) == breaker.Open })
		testutil.Eventually(t, "the hash expires", gone(t, srv.Addr))
		testutil.Eventually(t, "the replica sees the fleet calm", func() bool {
			a.call(herdguard.Success)
			return fleetState(a) == breaker.Closed
		})
		before := commands(t, srv.Addr)
		for range 100 {
			if ran, err := a.call(herdguard.Success); !ran || err != nil {
				t.Fatalf("a healthy call refused: %v", err)
			}
		}
		if n := commands(t, srv.Addr) - before; n > 20 {
			t.Errorf("100 healthy calls after the hash expired made %d Redis commands", n)
		}
	})
}
