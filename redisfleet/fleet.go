// Package redisfleet shares herdguard's circuit breakers across the replicas
// of a service through Redis: set a [Fleet] as breaker.Settings.Fleet, and
// replicas that name the same scope (a target, or a target and a method)
// share one breaker. It is a module of its own, so that herdguard itself
// does not depend on a Redis client.
//
// A shared breaker is one Redis hash per scope, changed only by Lua
// scripts timed by Redis's clock: the fleet's run of consecutive failed
// calls, its open period, and its half-open probe leases, so that at most
// HalfOpenMaxRequests probes run across the fleet per open period. Every
// transition is published on one channel, which each replica follows and
// applies to its breakers' views at once: when one replica's failure
// opens the breaker, every replica refuses within milliseconds.
//
// The closed path stays local. A healthy call reads its view with one
// atomic load and makes no round trip; a failure is queued for a worker
// goroutine and the caller does not wait. Only a call on an open breaker
// whose open period is over makes a round trip, bounded by
// [Options.Timeout], to lease a probe; told the leases are taken, the
// replica refuses by itself until they lapse or a verdict is published. A
// probe's verdict is queued too.
//
// When Redis cannot be reached, is slow or restarts, no call fails or
// waits past that bound because of it: each replica's own breaker decides
// alone, the loss is counted (herdguard.breaker.fleet.lost) and logged
// once, and when Redis answers again the replica reads the fleet's state
// back and follows it. A scope's state expires when no replica has written
// it for its TTL.
//
// Redis is reached through go-redis v9, the client most Go services that
// use Redis already have; the fleet needs no client-side caching, because
// the state it reads on every call is pushed to it.
package redisfleet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/herdguard/herdguard/internal/errs"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// Defaults that a zero field of [Options] stands for.
const (
	DefaultPrefix  = "herdguard:breaker:"
	DefaultTimeout = 50 * time.Millisecond
	DefaultQueue   = 1024
)

// Options configure a [Fleet]. A zero field means its default.
type Options struct {
	// Client reaches Redis (required). Give it ContextTimeoutEnabled, so
	// that Timeout bounds every command, and short dial, read and write
	// timeouts, so that a Redis that went away is noticed quickly:
	//
	//	redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true,
	//		DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond,
	//		WriteTimeout: 100 * time.Millisecond, MaxRetries: -1})
	Client redis.UniversalClient
	// Prefix starts every key and the channel. "" means DefaultPrefix.
	Prefix string
	// Timeout bounds every Redis command: the longest a call waits for a
	// probe lease, and how slow Redis may be before the replica falls back
	// to its own breakers. 0 means DefaultTimeout (50 ms).
	Timeout time.Duration
	// TTL is how long a scope's state outlives its last write. 0 means
	// twice the breaker's Window plus its OpenTimeout (25 s by default),
	// at least twice the OpenTimeout.
	TTL time.Duration
	// Queue is how many failures and recoveries wait for the worker before
	// more are dropped (and counted). 0 means DefaultQueue.
	Queue int
	// MeterProvider records the fleet's metrics; nil means the global one.
	MeterProvider metric.MeterProvider
	// Logger says when Redis is lost and when it is back, once each time;
	// nil means slog.Default().
	Logger *slog.Logger
}

// Fleet shares breakers through Redis. It is safe for concurrent use.
// Close it when done.
type Fleet struct {
	client  redis.UniversalClient
	prefix  string
	channel string
	timeout time.Duration
	ttl     time.Duration
	log     *slog.Logger
	metrics metrics

	queue  chan event
	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	members map[string][]*member // by scope
	// lost is true until the first resync and whenever Redis stopped
	// answering since: views are not updated from Redis until a resync.
	lost bool
	// warned is true once the current loss was logged and counted.
	warned bool
	// epoch counts losses, so that a resync that a loss overtook does not
	// end it.
	epoch  uint64
	synced chan struct{} // closed once the first subscription is confirmed
	ps     *redis.PubSub // the subscription; Close closes it to end a blocked receive
}

type eventKind uint8

const (
	evFailed eventKind = iota
	evRecovered
	evSync
	evProbeDone
	evFlush // closes done once every earlier event ran (tests)
)

type event struct {
	m    *member
	kind eventKind
	// a probe's verdict: its lease's generation and round, and "s", "f"
	// or "i"
	gen, round int64
	verdict    string
	done       chan struct{} // evFlush
}

// New returns a fleet over opts.Client and starts following its channel.
func New(opts Options) (*Fleet, error) {
	if opts.Client == nil {
		return nil, errs.New("redisfleet: Options.Client is nil: the fleet needs a Redis client")
	}
	if opts.Timeout < 0 {
		return nil, errs.Errorf("redisfleet: Options.Timeout = %v: must not be negative", opts.Timeout)
	}
	if opts.TTL < 0 {
		return nil, errs.Errorf("redisfleet: Options.TTL = %v: must not be negative", opts.TTL)
	}
	if opts.Queue < 0 {
		return nil, errs.Errorf("redisfleet: Options.Queue = %d: must not be negative", opts.Queue)
	}
	if opts.Prefix == "" {
		opts.Prefix = DefaultPrefix
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.Queue == 0 {
		opts.Queue = DefaultQueue
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.MeterProvider == nil {
		opts.MeterProvider = otel.GetMeterProvider()
	}
	f := &Fleet{
		client:  opts.Client,
		prefix:  opts.Prefix,
		channel: opts.Prefix + "events",
		timeout: opts.Timeout,
		ttl:     opts.TTL,
		log:     opts.Logger,
		queue:   make(chan event, opts.Queue),
		members: map[string][]*member{},
		lost:    true,
		synced:  make(chan struct{}),
	}
	f.metrics.init(opts.MeterProvider, f)
	f.ctx, f.cancel = context.WithCancel(context.Background())
	f.wg.Add(2)
	go f.work()
	go f.follow()
	return f, nil
}

// Close stops following the channel and the worker; reports still queued
// are dropped, and every breaker that joined decides alone from then on.
// It does not close the client.
func (f *Fleet) Close() error {
	f.cancel()
	f.mu.Lock()
	if f.ps != nil {
		f.ps.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	f.mu.Lock()
	f.lost, f.warned = true, true
	for _, ms := range f.members {
		for _, m := range ms {
			m.view.Lost()
		}
	}
	f.mu.Unlock()
	return f.metrics.close()
}

// WaitSynced waits until the fleet has subscribed to its channel and read
// back the state of the scopes joined so far, or ctx ends.
func (f *Fleet) WaitSynced(ctx context.Context) error {
	select {
	case <-f.synced:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Join implements breaker.Fleet: it starts sharing the breaker of scope.
// It queues a read of the scope's state and returns at once; until that
// read answers, the replica's own breaker decides alone.
func (f *Fleet) Join(scope string, s breaker.Settings, view *breaker.FleetView) breaker.FleetMember {
	ttl := f.ttl
	if ttl == 0 {
		ttl = 2*s.Window + s.OpenTimeout
	}
	ttl = max(ttl, 2*s.OpenTimeout)
	m := &member{f: f, scope: scope, key: f.prefix + scope, view: view}
	m.args = []any{f.channel, scope, ttl.Milliseconds(), s.ConsecutiveFailures, s.OpenTimeout.Milliseconds(), max(s.HalfOpenMaxRequests, 1), s.DownAfter.Milliseconds()}
	m.lease = s.OpenTimeout.Milliseconds()
	f.mu.Lock()
	f.members[scope] = append(f.members[scope], m)
	f.mu.Unlock()
	f.enqueue(event{m: m, kind: evSync})
	return m
}

// enqueue hands an event to the worker, or drops and counts it when the
// queue is full: a caller never waits for Redis.
func (f *Fleet) enqueue(e event) {
	select {
	case f.queue <- e:
	default:
		f.metrics.dropped.Add(context.Background(), 1)
	}
}

// work runs the queued reports against Redis.
func (f *Fleet) work() {
	defer f.wg.Done()
	for {
		select {
		case <-f.ctx.Done():
			return
		case e := <-f.queue:
			var err error
			switch e.kind {
			case evFailed:
				_, err = e.m.run(failedScript)
			case evRecovered:
				_, err = e.m.run(recoveredScript)
			case evProbeDone:
				_, err = e.m.run(probeDoneScript, e.gen, e.round, e.verdict)
			case evFlush:
				close(e.done)
			default:
				_, _ = e.m.run(readScript)
			}
			if err != nil {
				f.metrics.dropped.Add(context.Background(), 1)
			}
		}
	}
}

// follow subscribes to the fleet's channel and applies what it hears. A
// confirmed subscription (at start, and after every reconnection), and
// anything heard while the fleet is lost, reads back every scope's state,
// so a replica that lost Redis rejoins the fleet's state when it returns.
// A quiet channel is pinged; a ping left unanswered for a whole wait
// counts as a loss, and the subscription is made again.
func (f *Fleet) follow() {
	defer f.wg.Done()
	pingEvery := max(2*f.timeout, 500*time.Millisecond)
	subscribe := func() *redis.PubSub {
		ps := f.client.Subscribe(f.ctx, f.channel)
		f.mu.Lock()
		f.ps = ps
		f.mu.Unlock()
		return ps
	}
	ps := subscribe()
	defer func() { ps.Close() }()
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(f.ctx, pingEvery)
		if f.ctx.Err() != nil {
			return
		}
		var ne net.Error
		switch {
		case err != nil && errors.As(err, &ne) && ne.Timeout() && !pinged:
			// a quiet channel: ask for a pong, due within the next wait
			pinged = true
			pctx, cancel := context.WithTimeout(f.ctx, f.timeout)
			if perr := ps.Ping(pctx); perr != nil {
				f.lose(perr)
			}
			cancel()
			continue
		case err != nil:
			if errors.As(err, &ne) && ne.Timeout() {
				err = fmt.Errorf("no answer to a ping within %v: %w", pingEvery, err)
				ps.Close() // a connection that answers nothing: subscribe again
				ps = subscribe()
			}
			pinged = false
			f.lose(err)
			// go-redis reconnects (and subscribes again) on the next receive
			select {
			case <-f.ctx.Done():
				return
			case <-time.After(pingEvery / 5):
			}
			continue
		}
		pinged = false
		switch msg := msg.(type) {
		case *redis.Subscription:
			f.resync()
			continue
		case *redis.Message:
			f.apply(msg.Payload)
		}
		if f.isLost() {
			f.resync()
		}
	}
}

// resync reads every scope's state back and marks the fleet reachable,
// unless Redis was lost again meanwhile.
func (f *Fleet) resync() {
	f.mu.Lock()
	epoch := f.epoch
	var all []*member
	for _, ms := range f.members {
		all = append(all, ms...)
	}
	f.mu.Unlock()
	read := make([]result, len(all))
	for i, m := range all {
		r, err := m.run(readScript)
		if err != nil {
			return // lost again; what is heard next retries
		}
		read[i] = r
	}
	f.mu.Lock()
	if f.epoch != epoch {
		f.mu.Unlock()
		return
	}
	for i, m := range all {
		m.setLocked(read[i], true)
	}
	wasLost := f.warned
	f.lost, f.warned = false, false
	select {
	case <-f.synced:
	default:
		close(f.synced)
	}
	f.mu.Unlock()
	if wasLost {
		f.log.Info("redisfleet: Redis answers again; breakers follow the fleet's state", "channel", f.channel)
	}
}

// apply applies a published change to the scope's views.
func (f *Fleet) apply(payload string) {
	parts := strings.SplitN(payload, "\n", 4)
	if len(parts) != 4 {
		return
	}
	remaining, err1 := strconv.ParseInt(parts[2], 10, 64)
	gen, err2 := strconv.ParseInt(parts[3], 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	r := result{state: parts[1], remaining: remaining, gen: gen}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range f.members[parts[0]] {
		m.setLocked(r, false)
	}
}

// lose marks every view lost, so each replica's own breakers decide, and
// says so once per loss.
func (f *Fleet) lose(err error) {
	f.mu.Lock()
	f.epoch++
	if f.lost && f.warned {
		f.mu.Unlock()
		return
	}
	f.lost, f.warned = true, true
	for _, ms := range f.members {
		for _, m := range ms {
			m.view.Lost()
		}
	}
	f.mu.Unlock()
	// Logged before it is counted, so that whoever sees the count finds the
	// line.
	f.log.Warn("redisfleet: Redis cannot be reached; each replica's own breakers decide until it answers again",
		"channel", f.channel, "error", err)
	f.metrics.lost.Add(context.Background(), 1)
}

func (f *Fleet) isLost() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lost
}

// member is one breaker's link to its scope's shared state.
type member struct {
	f          *Fleet
	scope, key string
	view       *breaker.FleetView
	args       []any // the scripts' common ARGV
	lease      int64 // ms a probe lease lasts
	gen        int64 // the generation the view shows; guarded by f.mu
}

// Failed implements breaker.FleetMember.
func (m *member) Failed() { m.f.enqueue(event{m: m, kind: evFailed}) }

// Recovered implements breaker.FleetMember.
func (m *member) Recovered() { m.f.enqueue(event{m: m, kind: evRecovered}) }

// Probe implements breaker.FleetMember: it asks Redis for a probe lease,
// waiting at most the fleet's Timeout.
func (m *member) Probe(ctx context.Context) (breaker.ProbeLease, error) {
	r, err := m.run(probeScript, m.lease)
	switch {
	case err != nil:
		return nil, err
	case r.state == "granted":
		m.f.metrics.probes.Add(ctx, 1)
		return &lease{m: m, gen: r.gen, round: r.round}, nil
	case r.state == "calm" || r.state == "suspect":
		return nil, nil // the view was behind: the breaker closed meanwhile
	}
	// taken (the view now refuses until the leases lapse or a verdict is
	// published), or the open period is not over on Redis's clock
	return nil, breaker.ErrProbesTaken
}

// result is what every script returns.
type result struct {
	state     string
	remaining int64
	gen       int64
	round     int64 // of a granted lease
}

// run runs script on the member's scope within the fleet's Timeout,
// applies the state it returns to the view, and marks the fleet lost when
// Redis does not answer.
func (m *member) run(script *redis.Script, extra ...any) (result, error) {
	ctx, cancel := context.WithTimeout(m.f.ctx, m.f.timeout)
	defer cancel()
	args := append(m.args[:len(m.args):len(m.args)], extra...)
	v, err := script.Run(ctx, m.f.client, []string{m.key}, args...).Slice()
	if err != nil {
		if m.f.ctx.Err() == nil {
			m.f.lose(err)
		}
		return result{}, err
	}
	if len(v) < 3 {
		return result{}, errs.Errorf("redisfleet: script returned %v", v)
	}
	r := result{}
	r.state, _ = v[0].(string)
	r.remaining, _ = v[1].(int64)
	r.gen, _ = v[2].(int64)
	if len(v) > 3 {
		r.round, _ = v[3].(int64)
	}
	m.f.mu.Lock()
	m.setLocked(r, false)
	m.f.mu.Unlock()
	return r, nil
}

// setLocked applies a state heard from Redis to the view, unless the fleet
// is lost (a resync, force, comes first) or the view already shows a
// newer generation. "taken" refuses until the leases lapse. f.mu is held.
func (m *member) setLocked(r result, force bool) {
	if !force && (m.f.lost || r.gen < m.gen) {
		return
	}
	m.gen = r.gen
	switch r.state {
	case "calm":
		m.view.Calm()
	case "suspect":
		m.view.Suspect()
	case "open":
		m.view.Open(time.Duration(r.remaining) * time.Millisecond)
	case "taken":
		m.view.Taken(time.Duration(r.remaining) * time.Millisecond)
	}
}

// lease is a granted probe lease of generation gen and round.
type lease struct {
	m          *member
	gen, round int64
}

// Done implements breaker.ProbeLease: the verdict goes to the worker, and
// the caller does not wait. (Dropped, when the queue is full: the lease
// then lapses, and another replica probes.)
func (l *lease) Done(v herdguard.Verdict) {
	verdict := "s"
	switch v {
	case herdguard.Failure:
		verdict = "f"
	case herdguard.Ignored:
		verdict = "i"
	}
	l.m.f.enqueue(event{m: l.m, kind: evProbeDone, gen: l.gen, round: l.round, verdict: verdict})
}
