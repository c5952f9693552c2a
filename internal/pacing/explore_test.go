package pacing

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

type scenario struct {
	name    string
	srv     func() server
	l       load
	trigEnd time.Duration
}

func scenarios() []scenario {
	cut := func(to int, dur time.Duration) func() server {
		return func() server {
			s := newSticky(80)
			s.cutTo, s.trigger, s.triggerFor = to, 3*time.Second, dur
			return s
		}
	}
	herd := func(c int) func() server { return func() server { return newSticky(c) } }
	dead := steadyLoad()
	dead.rate, dead.dur = 300, 10*time.Second
	part := steadyLoad()
	part.dur = 6 * time.Second
	return []scenario{
		{"cut", cut(30, 2*time.Second), steadyLoad(), 5 * time.Second},
		{"outage", cut(0, time.Second), steadyLoad(), 4 * time.Second},
		{"gentle", func() server {
			return &gentle{capacity: 80, cutTo: 30, trigger: 3 * time.Second, triggerFor: 2 * time.Second, window: 100 * time.Millisecond, queueLimit: time.Second}
		}, steadyLoad(), 5 * time.Second},
		{"herd20", herd(20), herdLoad(), 0},
		{"herd80", herd(80), herdLoad(), 0},
		{"herd320", herd(320), herdLoad(), 0},
		{"p0.5", func() server { return &flaky{p: 0.5} }, part, 0},
		{"p0.67", func() server { return &flaky{p: 0.67} }, part, 0},
		{"p0.8", func() server { return &flaky{p: 0.8} }, part, 0},
		{"dead", func() server { return &flaky{deadFrom: 2 * time.Second, deadFor: 4 * time.Second} }, dead, 6 * time.Second},
	}
}

func TestExplore(t *testing.T) {
	if os.Getenv("HERDGUARD_SIM_EXPLORE") == "" {
		t.Skip("HERDGUARD_SIM_EXPLORE=1 prints the simulated storm lab")
	}
	for _, sc := range selected() {
		for _, n := range []int{1, 10, 40, 100} {
			for _, st := range strategies {
				fmt.Printf("%-8s N=%-3d %-9s %v\n", sc.name, n, st, runStrategy(sc, n, st, 1))
			}
		}
	}
}

// strategies are the simulated lab's rows: no retries, policy.Default's
// retries alone, and herdguard's controller with its defaults.
var strategies = []string{"none", "retries", "herdguard"}

// runStrategy runs scenario sc offered by n clients with strategy st.
func runStrategy(sc scenario, n int, st string, seed uint64) result {
	l := sc.l
	var set *overload.Settings
	switch st {
	case "none":
		l.policy = policy.Policy{MaxAttempts: 1}
	case "herdguard":
		set = &overload.Settings{DownAfter: downAfter()}
	}
	return newFleet(seed, n, sc.srv(), l, set).run().result(sc.trigEnd)
}

// selected returns the scenarios HERDGUARD_SIM_ONLY names (a comma list),
// all without it.
func selected() []scenario {
	only := os.Getenv("HERDGUARD_SIM_ONLY")
	var out []scenario
	for _, sc := range scenarios() {
		if only == "" || strings.Contains(","+only+",", ","+sc.name+",") {
			out = append(out, sc)
		}
	}
	return out
}

// trace prints, every 100 ms of a run, the server's arrivals and state and
// client 0's controller.
func (f *fleet) trace(from, to time.Duration) {
	var tick func()
	tick = func() {
		t := f.s.since()
		if t >= from && t <= to {
			c := f.ctls[0]
			c.mu.Lock()
			ep := c.ep
			arr := 0
			for i := int(t/(10*time.Millisecond)) - 10; i < int(t/(10*time.Millisecond)); i++ {
				if i >= 0 && i < len(f.perTenth) {
					arr += f.perTenth[i]
				}
			}
			srv := ""
			if s, ok := f.srv.(*sticky); ok && s.overloaded {
				srv = "DOWN"
			}
			paced, coll := 0, 0
			var rates, targets float64
			for _, o := range f.ctls[1:] {
				if o.pacing.Load() {
					paced++
					rates += o.ep.rate
					targets += o.ep.target
					if o.ep.collapsed {
						coll++
					}
				}
			}
			fmt.Printf("Σrate=%5.1f Σtarget=%5.1f paced=%3d coll=%3d t=%5.2f arr=%4d %-4s pacing=%-5v coll=%-5v down=%-5v rate=%6.2f target=%6.2f known=%6.2f base=%.2f line=%4d setbacks=%d edf=%v\n",
				rates, targets, paced, coll, t.Seconds(), arr, srv, c.pacing.Load(), ep.collapsed, ep.down, ep.rate, ep.target, c.known, c.base, len(c.line), ep.setbacks, c.edf)
			c.mu.Unlock()
		}
		if t < to {
			f.s.after(100*time.Millisecond, tick)
		}
	}
	f.s.after(0, tick)
}

func TestTrace(t *testing.T) {
	if os.Getenv("HERDGUARD_SIM_TRACE") == "" {
		t.Skip()
	}
	var n int
	fmt.Sscan(os.Getenv("HERDGUARD_SIM_N"), &n)
	for _, sc := range scenarios() {
		if sc.name != os.Getenv("HERDGUARD_SIM_TRACE") {
			continue
		}
		var seed uint64 = 1
		fmt.Sscan(os.Getenv("HERDGUARD_SIM_SEED"), &seed)
		f := newFleet(seed, max(n, 1), sc.srv(), sc.l, &overload.Settings{DownAfter: downAfter()})
		f.trace(traceFrom(), 8*time.Second)
		f.run()
		fmt.Println(f.result(sc.trigEnd))
	}
}

func downAfter() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("HERDGUARD_SIM_DOWN"))
	return d
}

func traceFrom() time.Duration {
	d, err := time.ParseDuration(os.Getenv("HERDGUARD_SIM_FROM"))
	if err != nil {
		return 2500 * time.Millisecond
	}
	return d
}

func TestLate(t *testing.T) {
	if os.Getenv("HERDGUARD_SIM_LATE") == "" {
		t.Skip()
	}
	for _, sc := range scenarios() {
		if sc.name != os.Getenv("HERDGUARD_SIM_LATE") {
			continue
		}
		f := newFleet(1, 1, sc.srv(), sc.l, &overload.Settings{})
		f.run()
		n := 0
		for i, c := range f.calls {
			if c.end > 2*time.Second && n < 10 {
				n++
				fmt.Printf("call %d start %v end %v %s\n", i, c.start, c.end, c.how)
			}
		}
	}
}

func TestClients(t *testing.T) {
	if os.Getenv("HERDGUARD_SIM_CLIENTS") == "" {
		t.Skip()
	}
	var n int
	fmt.Sscan(os.Getenv("HERDGUARD_SIM_N"), &n)
	for _, sc := range scenarios() {
		if sc.name != os.Getenv("HERDGUARD_SIM_CLIENTS") {
			continue
		}
		f := newFleet(1, n, sc.srv(), sc.l, &overload.Settings{})
		f.run()
		for i, c := range f.ctls {
			var ok, all int
			var last time.Duration
			for k := i; k < len(f.calls); k += n {
				all++
				if f.calls[k].ok {
					ok++
					last = max(last, f.calls[k].end)
				}
			}
			if ok < all {
				fmt.Printf("client %2d ok %d/%d last %v pacing %v rate %.2f target %.2f known %.2f coll %v down %v base %.2f\n", i, ok, all, last, c.pacing.Load(), c.ep.rate, c.ep.target, c.known, c.ep.collapsed, c.ep.down, c.base)
			}
		}
	}
}

// TestSummary prints, for every scenario and fleet size, the calls ok
// of no retries, retries alone and herdguard, means over
// HERDGUARD_SIM_SUMMARY seeds, and herdguard's least.
func TestSummary(t *testing.T) {
	var seeds int
	fmt.Sscan(os.Getenv("HERDGUARD_SIM_SUMMARY"), &seeds)
	if seeds == 0 {
		t.Skip("HERDGUARD_SIM_SUMMARY=5 prints the simulated storm lab over 5 seeds")
	}
	for _, sc := range selected() {
		for _, n := range []int{1, 10, 40, 100} {
			var line strings.Builder
			fmt.Fprintf(&line, "%-8s N=%-3d", sc.name, n)
			for _, st := range strategies {
				sum, least := 0.0, 101.0
				var recs []time.Duration
				var att, last float64
				for seed := range seeds {
					r := runStrategy(sc, n, st, uint64(seed+1))
					att += float64(r.attempts) / float64(r.calls) / float64(seeds)
					last += r.last.Seconds() / float64(seeds)
					p := 100 * float64(r.ok) / float64(r.calls)
					sum += p
					least = min(least, p)
					recs = append(recs, r.recovery)
				}
				if st == "herdguard" {
					slices.Sort(recs) // never (-1) sorts first: it shows as the least
					fmt.Fprintf(&line, "  hg %5.1f (least %5.1f, rec median %v, most %v)", sum/float64(seeds), least, recs[len(recs)/2], recs[len(recs)-1])
					if sc.l.herd > 0 {
						fmt.Fprintf(&line, " att %.2f/call last %.1fs", att, last)
					}
				} else {
					fmt.Fprintf(&line, "  %s %5.1f", st, sum/float64(seeds))
				}
			}
			fmt.Println(line.String())
		}
	}
}
