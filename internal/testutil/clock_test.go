package testutil

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ms = time.Millisecond

var start = time.Unix(1000, 0)

// events is what a test's timers did, in the order they did it.
type events struct {
	mu  sync.Mutex
	got []string
}

func (e *events) add(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.got = append(e.got, fmt.Sprintf(format, args...))
}

func (e *events) list() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.got)
}

// since is how far c has moved from start.
func since(c *Clock) time.Duration { return c.Now().Sub(start) }

// TestClockSync runs timers on a manual clock without Async: each fires
// inside Advance, in order, with the clock at its due time.
func TestClockSync(t *testing.T) {
	for _, tt := range []struct {
		name string
		run  func(c *Clock, e *events)
		want []string
	}{
		{"due timers fire in order of due time, ties in the order set", func(c *Clock, e *events) {
			for _, n := range []struct {
				name string
				d    time.Duration
			}{{"c", 30 * ms}, {"a1", 10 * ms}, {"b", 20 * ms}, {"a2", 10 * ms}} {
				c.AfterFunc(n.d, func() { e.add("%s at %v", n.name, since(c)) })
			}
			c.Advance(25 * ms)
			e.add("advanced to %v", since(c))
			c.Advance(5 * ms)
		}, []string{"a1 at 10ms", "a2 at 10ms", "b at 20ms", "advanced to 25ms", "c at 30ms"}},
		{"nothing fires before Advance, nor after a short one", func(c *Clock, e *events) {
			c.AfterFunc(10*ms, func() { e.add("fired at %v", since(c)) })
			e.add("set")
			c.Advance(10*ms - 1)
			e.add("at %v", since(c))
			c.Advance(1)
		}, []string{"set", "at 9.999999ms", "fired at 10ms"}},
		{"a timer a function sets fires in the same Advance if due", func(c *Clock, e *events) {
			c.AfterFunc(10*ms, func() {
				e.add("first at %v", since(c))
				c.AfterFunc(5*ms, func() { e.add("second at %v", since(c)) })
				c.AfterFunc(50*ms, func() { e.add("third at %v", since(c)) })
			})
			c.Advance(20 * ms)
			e.add("advanced to %v", since(c))
		}, []string{"first at 10ms", "second at 15ms", "advanced to 20ms"}},
		{"a zero or negative delay fires at the next Advance, the clock never going back", func(c *Clock, e *events) {
			c.Advance(10 * ms)
			c.AfterFunc(-5*ms, func() { e.add("negative at %v", since(c)) })
			c.AfterFunc(0, func() { e.add("zero at %v", since(c)) })
			e.add("set")
			c.Advance(0)
		}, []string{"set", "negative at 10ms", "zero at 10ms"}},
		{"Stop keeps a timer from firing and says it was pending, once", func(c *Clock, e *events) {
			tm := c.AfterFunc(10*ms, func() { e.add("fired") })
			e.add("stop %v", tm.Stop())
			e.add("stop again %v", tm.Stop())
			c.Advance(time.Second)
		}, []string{"stop true", "stop again false"}},
		{"Stop after a fire says false", func(c *Clock, e *events) {
			tm := c.AfterFunc(10*ms, func() { e.add("fired") })
			c.Advance(10 * ms)
			e.add("stop %v", tm.Stop())
		}, []string{"fired", "stop false"}},
		{"Reset of a pending timer moves it and says true", func(c *Clock, e *events) {
			tm := c.AfterFunc(10*ms, func() { e.add("fired at %v", since(c)) })
			c.Advance(5 * ms)
			e.add("reset %v", tm.Reset(20*ms))
			c.Advance(10 * ms)
			e.add("at %v", since(c))
			c.Advance(10 * ms)
		}, []string{"reset true", "at 15ms", "fired at 25ms"}},
		{"Reset after a fire or a Stop sets the timer again and says false", func(c *Clock, e *events) {
			tm := c.AfterFunc(10*ms, func() { e.add("fired at %v", since(c)) })
			c.Advance(10 * ms)
			e.add("reset %v", tm.Reset(10*ms))
			c.Advance(10 * ms)
			tm.Stop()
			e.add("reset %v", tm.Reset(10*ms))
			c.Advance(10 * ms)
		}, []string{"fired at 10ms", "reset false", "fired at 20ms", "reset false", "fired at 30ms"}},
		{"a reset timer keeps its place among ties by when it was set last", func(c *Clock, e *events) {
			a := c.AfterFunc(10*ms, func() { e.add("a") })
			c.AfterFunc(10*ms, func() { e.add("b") })
			a.Reset(10 * ms)
			c.Advance(10 * ms)
		}, []string{"b", "a"}},
		{"Skip moves the clock and fires nothing; the next Advance fires what fell due", func(c *Clock, e *events) {
			c.AfterFunc(10*ms, func() { e.add("fired at %v", since(c)) })
			c.Skip(30 * ms)
			e.add("skipped to %v", since(c))
			c.Advance(0)
		}, []string{"skipped to 30ms", "fired at 30ms"}},
		{"a NewTimer sends the clock's time at its fire, once", func(c *Clock, e *events) {
			tm := c.NewTimer(10 * ms)
			c.Advance(15 * ms)
			select {
			case at := <-tm.C():
				e.add("received %v", at.Sub(start))
			default:
				e.add("nothing")
			}
			select {
			case <-tm.C():
				e.add("received twice")
			default:
			}
		}, []string{"received 10ms"}},
		{"Reset and Stop drop a fire nobody received", func(c *Clock, e *events) {
			tm := c.NewTimer(10 * ms)
			c.Advance(10 * ms)
			tm.Reset(10 * ms)
			e.add("after Reset: %d queued", len(tm.C()))
			c.Advance(10 * ms)
			tm.Stop()
			e.add("after Stop: %d queued", len(tm.C()))
			tm.Reset(10 * ms)
			c.Advance(10 * ms)
			e.add("received %v", (<-tm.C()).Sub(start))
		}, []string{"after Reset: 0 queued", "after Stop: 0 queued", "received 30ms"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, e := NewClock(start), &events{}
			tt.run(c, e)
			if got := e.list(); !slices.Equal(got, tt.want) {
				t.Errorf("got %q, want %q", got, tt.want)
			}
		})
	}
}

// TestClockAsync: with Async, Advance moves to its end and starts every
// due timer's function in its own goroutine.
func TestClockAsync(t *testing.T) {
	c := NewClock(start, Async())
	var (
		advancing sync.Mutex // held while Advance runs: a synchronous function would deadlock on it
		wg        sync.WaitGroup
		mu        sync.Mutex
		saw       []time.Duration
	)
	wg.Add(2)
	for _, d := range []time.Duration{20 * ms, 10 * ms} {
		c.AfterFunc(d, func() {
			defer wg.Done()
			advancing.Lock()
			defer advancing.Unlock()
			mu.Lock()
			defer mu.Unlock()
			saw = append(saw, since(c))
			c.AfterFunc(0, func() { t.Error("a timer set by a function fired in the same Advance") })
		})
	}
	c.AfterFunc(40*ms, func() { t.Error("a timer due after the Advance fired") })
	advancing.Lock()
	c.Advance(30 * ms)
	advancing.Unlock()
	wg.Wait()
	if !slices.Equal(saw, []time.Duration{30 * ms, 30 * ms}) {
		t.Errorf("the functions read %v, want the Advance's end, 30ms, twice", saw)
	}
	if got := since(c); got != 30*ms {
		t.Errorf("clock at %v, want 30ms", got)
	}
}

// TestClockExpire: Expire moves the clock to its end and hands back, in
// order and unrun, the functions of the timers due, which are no longer
// pending; a NewTimer due fires.
func TestClockExpire(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts []Option
	}{{"sync", nil}, {"async", []Option{Async()}}} {
		t.Run(tt.name, func(t *testing.T) {
			c, e := NewClock(start, tt.opts...), &events{}
			b := c.AfterFunc(20*ms, func() { e.add("b at %v", since(c)) })
			c.AfterFunc(10*ms, func() { e.add("a at %v", since(c)) })
			c.AfterFunc(40*ms, func() { e.add("c at %v", since(c)) })
			ch := c.NewTimer(15 * ms)
			due := c.Expire(30 * ms)
			e.add("expired to %v, %d due", since(c), len(due))
			for _, f := range due {
				f()
			}
			e.add("stop b %v", b.Stop())
			select {
			case at := <-ch.C():
				e.add("channel at %v", at.Sub(start))
			default:
				e.add("channel empty")
			}
			c.Advance(10 * ms)
			want := []string{"expired to 30ms, 2 due", "a at 30ms", "b at 30ms", "stop b false", "channel at 30ms", "c at 40ms"}
			if tt.opts != nil { // c runs in its own goroutine
				Eventually(t, "c to run", func() bool { return len(e.list()) == len(want) })
			}
			if got := e.list(); !slices.Equal(got, want) {
				t.Errorf("got %q, want %q", got, want)
			}
		})
	}
}

// TestClockInstant: with Instant every timer fires as it is set and moves
// the clock on by its delay.
func TestClockInstant(t *testing.T) {
	t.Run("NewTimer", func(t *testing.T) {
		c := NewClock(start, Instant())
		tm := c.NewTimer(10 * ms)
		if at := <-tm.C(); at.Sub(start) != 10*ms {
			t.Errorf("fired at %v, want 10ms", at.Sub(start))
		}
		if tm.Stop() {
			t.Error("Stop of a timer that fired said it was pending")
		}
		if tm.Reset(5 * ms) {
			t.Error("Reset of a timer that fired said it was pending")
		}
		if at := <-tm.C(); at.Sub(start) != 15*ms {
			t.Errorf("fired again at %v, want 15ms", at.Sub(start))
		}
		c.NewTimer(-time.Second)
		if got := since(c); got != 15*ms {
			t.Errorf("after a negative delay the clock is at %v, want 15ms still", got)
		}
		c.Advance(time.Second) // as time passing between calls: no timer is pending
		if got := since(c); got != 1015*ms {
			t.Errorf("after Advance the clock is at %v, want 1.015s", got)
		}
		if got, want := c.Delays(), []time.Duration{10 * ms, 5 * ms, -time.Second}; !slices.Equal(got, want) {
			t.Errorf("delays %v, want %v (Advance is no wait)", got, want)
		}
	})
	t.Run("AfterFunc", func(t *testing.T) {
		c := NewClock(start, Instant())
		var at time.Duration
		c.AfterFunc(10*ms, func() { at = since(c) })
		if at != 10*ms {
			t.Errorf("the function read %v before AfterFunc returned, want 10ms", at)
		}
	})
	t.Run("AfterFunc with Async", func(t *testing.T) {
		c := NewClock(start, Instant(), Async())
		var (
			held  sync.Mutex // a synchronous function would deadlock on it
			fired = make(chan time.Duration)
		)
		held.Lock()
		c.AfterFunc(10*ms, func() {
			held.Lock()
			defer held.Unlock()
			fired <- since(c)
		})
		held.Unlock()
		if got := <-fired; got != 10*ms {
			t.Errorf("the function read %v, want 10ms", got)
		}
	})
}

// TestClockDelays: every delay a timer is set to is recorded, in order,
// whether or not it fires.
func TestClockDelays(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts []Option
	}{
		{"manual", nil},
		{"manual, async", []Option{Async()}},
		{"instant", []Option{Instant()}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := NewClock(start, tt.opts...)
			var wg sync.WaitGroup
			wg.Add(2) // an instant AfterFunc fires at creation and at its Reset
			a := c.AfterFunc(3*ms, func() {
				if c.instant {
					wg.Done()
				}
			})
			tm := c.NewTimer(1 * ms)
			a.Reset(2 * ms)
			tm.Stop()
			tm.Reset(4 * ms)
			c.Skip(time.Second)
			c.Advance(time.Second)
			if c.instant {
				wg.Wait()
			}
			if got, want := c.Delays(), []time.Duration{3 * ms, 1 * ms, 2 * ms, 4 * ms}; !slices.Equal(got, want) {
				t.Errorf("delays %v, want %v", got, want)
			}
		})
	}
}

// TestClockConcurrent sets, stops and fires timers from many goroutines
// while the clock advances, for the race detector: every timer fires once
// unless a Stop caught it pending.
func TestClockConcurrent(t *testing.T) {
	c := NewClock(start)
	var (
		wg             sync.WaitGroup
		fired, stopped sync.Map
	)
	for i := range 8 {
		wg.Go(func() {
			for j := range 100 {
				key := fmt.Sprint(i, "/", j)
				tm := c.AfterFunc(time.Duration(j)*ms, func() {
					if _, again := fired.LoadOrStore(key, true); again {
						t.Errorf("timer %s fired twice", key)
					}
				})
				if j%2 == 1 && tm.Stop() {
					stopped.Store(key, true)
				}
				_ = c.Now()
			}
		})
	}
	for range 200 {
		c.Advance(ms)
	}
	wg.Wait()
	c.Advance(time.Hour)
	for i := range 8 {
		for j := range 100 {
			key := fmt.Sprint(i, "/", j)
			_, f := fired.Load(key)
			_, s := stopped.Load(key)
			if f == s {
				t.Errorf("timer %s: fired %v, stopped while pending %v; want exactly one", key, f, s)
			}
		}
	}
}
