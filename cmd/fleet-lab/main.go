// Command fleet-lab is the storm lab's fleet scenario: replicas of a
// service, each a separate OS process with its own herdguard interceptor,
// call one backend that dies and later recovers, with breakers of their own
// or one breaker shared through a real Redis (package redisfleet), and
// once with Redis killed while the backend is down.
//
//	fleet-lab                 # full scale, medians of 3 runs
//	fleet-lab -runs 1 -scale 4
//
// It starts Debian's redis-server on 127.0.0.1 with a free port and the
// demo gateway in process, and stops every process it started by its
// process id.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/herdguard/herdguard/cmd/stormlab"
	"github.com/herdguard/herdguard/internal/proc"
	"github.com/herdguard/herdguard/internal/redistest"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// replicaEnv makes this binary (or a test binary) run as a replica.
const replicaEnv = "FLEETLAB_REPLICA"

func main() {
	log.SetFlags(0)
	log.SetPrefix("fleet-lab: ")
	if os.Getenv(replicaEnv) != "" {
		if err := replicaMain(os.Args[1:], os.Stdout); err != nil {
			log.Fatal(err)
		}
		return
	}
	var o labOptions
	flag.IntVar(&o.runs, "runs", 3, "runs of each strategy; the table gives medians")
	flag.Float64Var(&o.scale, "scale", 1, "divide every duration by this")
	flag.IntVar(&o.replicas, "replicas", 8, "replicas in the fleet")
	flag.Float64Var(&o.rate, "rate", 160, "calls per second of the whole fleet (at full scale)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := lab(ctx, o, os.Stdout, os.Stderr); err != nil {
		log.Fatal(err)
	}
}

// labOptions configure the lab.
type labOptions struct {
	runs, replicas int
	scale, rate    float64
}

// The scenario at full scale.
const (
	healthyBefore = 1 * time.Second // calls before the backend dies
	outage        = 6 * time.Second // the backend fails every attempt
	healthyAfter  = 3 * time.Second // calls after it recovered
	openTimeout   = time.Second     // the breakers' open period
)

// strategy is one way the fleet runs.
type strategy struct {
	name     string
	replicas int  // 0: the lab's
	shared   bool // one breaker through Redis
	// kill, when not 0, kills Redis this long after the first call (at
	// full scale), and starts it again down later.
	kill, down time.Duration
}

var strategies = []strategy{
	{name: "one replica alone (the fleet's whole load)", replicas: 1},
	{name: "8 replicas, own breakers"},
	{name: "8 replicas, one shared breaker (Redis)", shared: true},
	{name: "shared; Redis killed while the backend is up (0.2 s to 0.7 s)", shared: true, kill: 200 * time.Millisecond, down: 500 * time.Millisecond},
	{name: "shared; Redis killed 1.5 s into the outage, back 1 s later", shared: true, kill: healthyBefore + 1500*time.Millisecond, down: time.Second},
}

// result is what one run measured.
type result struct {
	deadAttempts  int64         // attempts that reached the dead backend
	openSpread    time.Duration // from the first replica opening to the last
	neverOpened   int           // replicas that never opened
	periods       float64       // open periods, per replica (shared: the fleet's)
	probes        int           // probes sent into the dead backend across the fleet
	failedAfter   int           // calls started after recovery that did not succeed
	failedUp      int           // calls that ended before the backend died and did not succeed
	slowUp        time.Duration // the slowest call that ended before the backend died
	slowRefusal   time.Duration // the slowest refused call
	rejoin        time.Duration // after Redis returned, until every replica followed it again
	calls, failed int
}

// lab runs every strategy o.runs times and prints a table of medians.
func lab(ctx context.Context, o labOptions, out, progress io.Writer) (map[string][]result, error) {
	bin, err := redistest.Find()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "fleet-lab")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	rs, err := redistest.StartServer(bin, dir)
	if err != nil {
		return nil, err
	}
	defer rs.Stop()
	rc := redis.NewClient(&redis.Options{Addr: rs.Addr})
	defer rc.Close()

	srv, err := stormlab.NewServer(stormlab.Faults{})
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	g := srv.Register()
	go g.Serve(lis)
	defer g.Stop()

	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	all := map[string][]result{}
	for run := range o.runs {
		for _, st := range strategies {
			fmt.Fprintf(progress, "[run %d/%d] %s\n", run+1, o.runs, st.name)
			if err := rc.FlushAll(ctx).Err(); err != nil {
				return nil, fmt.Errorf("flush redis: %w", err)
			}
			r, err := runOnce(ctx, o, st, exe, lis.Addr().String(), rs, srv)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", st.name, err)
			}
			all[st.name] = append(all[st.name], r)
		}
	}
	writeTable(out, o, all)
	return all, nil
}

// runOnce runs one strategy once.
func runOnce(ctx context.Context, o labOptions, st strategy, exe, addr string, rs *redistest.Server, srv *stormlab.Server) (result, error) {
	scale := func(d time.Duration) time.Duration { return time.Duration(float64(d) / o.scale) }
	n := o.replicas
	if st.replicas > 0 {
		n = st.replicas
	}
	start := time.Now().Add(time.Second) // time for the replicas to start and sync
	deadAt := start.Add(scale(healthyBefore))
	recoveredAt := deadAt.Add(scale(outage))
	end := recoveredAt.Add(scale(healthyAfter))

	var procs []*proc.Process
	var outs []*bytes.Buffer
	var errs []*bytes.Buffer
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	for i := range n {
		args := []string{"-addr", addr, "-rate", strconv.FormatFloat(o.rate*o.scale/float64(n), 'f', -1, 64),
			"-start", strconv.FormatInt(start.UnixNano(), 10), "-end", strconv.FormatInt(end.UnixNano(), 10),
			"-recovered", strconv.FormatInt(recoveredAt.UnixNano(), 10),
			"-open-timeout", scale(openTimeout).String(), "-deadline", scale(2 * time.Second).String(),
			"-base", scale(100 * time.Millisecond).String()}
		if st.shared {
			args = append(args, "-redis", rs.Addr)
		}
		var so, se bytes.Buffer
		p, err := proc.Start(exe, &so, &se, append(os.Environ(), replicaEnv+"=1"), args...)
		if err != nil {
			return result{}, fmt.Errorf("replica %d: %w", i, err)
		}
		procs, outs, errs = append(procs, p), append(outs, &so), append(errs, &se)
	}

	// the backend dies at deadAt for the outage; Redis may be killed too.
	// Both end, and are waited for, before this run returns.
	var restartedAt time.Time
	var wg sync.WaitGroup
	fctx, cancel := context.WithCancel(ctx)
	defer func() { cancel(); wg.Wait() }()
	faultErr := make(chan error, 2)
	until := func(t time.Time) bool {
		select {
		case <-fctx.Done():
			return false
		case <-time.After(time.Until(t)):
			return true
		}
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		if !until(deadAt) {
			return
		}
		_, err := srv.ResetStats(fctx, &demov1.ResetStatsRequest{Faults: stormlab.Faults{Outage: scale(outage), Window: stormlab.DefaultWindow}.Proto()})
		if err != nil {
			faultErr <- err
		}
	}()
	if st.kill > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !until(start.Add(scale(st.kill))) {
				return
			}
			rs.Kill()
			if !until(start.Add(scale(st.kill + st.down))) {
				return
			}
			restartedAt = time.Now() // before Restart: a replica may follow it before Restart returns
			if err := rs.Restart(); err != nil {
				faultErr <- err
			}
		}()
	}
	var reports []report
	for i, p := range procs {
		if err := p.Wait(ctx); err != nil {
			return result{}, fmt.Errorf("replica %d (pid %d): %w\n%s", i, p.PID(), err, errs[i].String())
		}
		var rep report
		if err := json.Unmarshal(outs[i].Bytes(), &rep); err != nil {
			return result{}, fmt.Errorf("replica %d: %w\n%s", i, err, errs[i].String())
		}
		reports = append(reports, rep)
	}
	wg.Wait()
	select {
	case err := <-faultErr:
		return result{}, err
	default:
	}
	stats, err := srv.GetStats(ctx, &demov1.GetStatsRequest{})
	if err != nil {
		return result{}, err
	}
	return measure(reports, st, stats.GetFailed(), deadAt, recoveredAt, restartedAt, scale(openTimeout)), nil
}

// measure turns the replicas' reports into a run's result.
func measure(reports []report, st strategy, deadAttempts int64, deadAt, recoveredAt, restartedAt time.Time, open time.Duration) result {
	r := result{deadAttempts: deadAttempts}
	whose := "own"
	if st.shared {
		whose = "shared"
	}
	var firstOpen []int64
	var periods []int
	for _, rep := range reports {
		first, count := int64(0), 0
		for _, t := range rep.Transitions {
			if t.Whose != whose || t.State != "open" || t.At < deadAt.UnixNano() {
				continue
			}
			if first == 0 {
				first = t.At
			}
			count++
		}
		if first == 0 {
			r.neverOpened++
		} else {
			firstOpen = append(firstOpen, first)
		}
		periods = append(periods, count)
		for _, at := range rep.Probes {
			if at >= deadAt.UnixNano() && at < recoveredAt.UnixNano() {
				r.probes++ // into the dead backend
			}
		}
		for _, c := range rep.Calls {
			r.calls++
			if c.Outcome != "ok" {
				r.failed++
			}
			if c.At >= recoveredAt.UnixNano() && c.Outcome != "ok" {
				r.failedAfter++
			}
			if c.At+c.Took < deadAt.UnixNano() {
				if c.Outcome != "ok" {
					r.failedUp++
				}
				r.slowUp = max(r.slowUp, time.Duration(c.Took))
			}
			if c.Outcome == "refused" || c.Outcome == "refused_shared" {
				r.slowRefusal = max(r.slowRefusal, time.Duration(c.Took))
			}
		}
		if !restartedAt.IsZero() {
			back := int64(0)
			for _, t := range rep.Transitions {
				if t.Whose == "shared" && t.Shared && t.At >= restartedAt.UnixNano() {
					back = t.At
					break
				}
			}
			if back == 0 {
				r.rejoin = -1
			} else if r.rejoin >= 0 {
				r.rejoin = max(r.rejoin, time.Duration(back-restartedAt.UnixNano()))
			}
		}
	}
	if len(firstOpen) > 0 {
		r.openSpread = time.Duration(slices.Max(firstOpen) - slices.Min(firstOpen))
	}
	if st.shared {
		r.periods = float64(slices.Max(periods))
	} else {
		sum := 0
		for _, p := range periods {
			sum += p
		}
		r.periods = float64(sum) / float64(len(periods))
	}
	return r
}

// median returns the median of the runs' values of f.
func median(rs []result, f func(result) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

func writeTable(w io.Writer, o labOptions, all map[string][]result) {
	fmt.Fprintf(w, "\n== a fleet of %d replicas (separate processes), %.0f calls/s in all; the backend dies after %v for %v; breakers open for %v; medians of %d runs (scale 1/%g) ==\n\n",
		o.replicas, o.rate, healthyBefore, outage, openTimeout, o.runs, o.scale)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\tattempts at the dead backend\t× alone\tfirst to last open\treplicas never open\topen periods\tprobes\tprobes / period\tfailed while up\tslowest call while up\tfailed after recovery\tslowest refusal\trejoin after Redis returned\t")
	alone := median(all[strategies[0].name], func(r result) float64 { return float64(r.deadAttempts) })
	for _, st := range strategies {
		rs := all[st.name]
		dead := median(rs, func(r result) float64 { return float64(r.deadAttempts) })
		periods := median(rs, func(r result) float64 { return r.periods })
		probes := median(rs, func(r result) float64 { return float64(r.probes) })
		perPeriod := "-"
		if periods > 0 {
			perPeriod = strconv.FormatFloat(probes/periods, 'f', 1, 64)
		}
		rejoin := "-"
		if st.kill > 0 {
			d := median(rs, func(r result) float64 { return float64(r.rejoin) })
			if d < 0 {
				rejoin = "never"
			} else {
				rejoin = time.Duration(d).Round(time.Millisecond).String()
			}
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.2f\t%v\t%.0f\t%.1f\t%.0f\t%s\t%.0f\t%v\t%.0f\t%v\t%s\t\n", st.name, dead, dead/alone,
			time.Duration(median(rs, func(r result) float64 { return float64(r.openSpread) })).Round(100*time.Microsecond),
			median(rs, func(r result) float64 { return float64(r.neverOpened) }), periods, probes, perPeriod,
			median(rs, func(r result) float64 { return float64(r.failedUp) }),
			time.Duration(median(rs, func(r result) float64 { return float64(r.slowUp) })).Round(10*time.Microsecond),
			median(rs, func(r result) float64 { return float64(r.failedAfter) }),
			time.Duration(median(rs, func(r result) float64 { return float64(r.slowRefusal) })).Round(10*time.Microsecond), rejoin)
	}
	tw.Flush()
	fmt.Fprintln(w, `
attempts at the dead backend: counted by the server while it failed everything. "one replica alone" carries the
fleet's whole load in one process: a fleet sharing one breaker should send about what it sends. open periods: of
one replica (own breakers: the mean per replica); probes: half-open calls into the dead backend across the fleet;
probes / period: across the fleet in one open period. failed while up, slowest call while up: calls that ended before the backend
died. failed after recovery: calls started after the backend recovered that did not succeed (refused by a breaker
still open, or failed). slowest refusal: the longest a refused call took. rejoin: from Redis answering again until
every replica follows the fleet's state.`)
}
