// Package breaker decides when a client stops calling a failing server. It
// wraps sony/gobreaker v2 and counts logical calls, not attempts: the
// interceptor reports one [herdguard.Verdict] per call, after its retries are
// done, so a call that needed three attempts to succeed is one success.
//
//	g, err := breaker.NewGroup(breaker.Settings{ConsecutiveFailures: 5})
//	b := g.Get(cc.Target(), method)
//	before, after, err := b.Execute(func(probe bool) herdguard.Verdict { ... })
//	if errors.Is(err, breaker.ErrOpen) { ... } // rejected: nothing was sent
//
// # States
//
// Closed lets every call through and counts results. When the counts meet a
// trip condition it opens: by default, a run of 5 failed calls in a row
// that has lasted DownAfter (1 s) since its first failure, which is
// evidence that nothing succeeds, not chance; ConsecutiveFailures set
// explicitly trips on that many in a row however quickly they came; and a
// FailureRatio trips on that share of at least MinRequests calls in the
// Window.
//
// The default asks for the time as well as the count because a server
// that fails a share of its calls on its own makes runs of failures by
// chance: one that fails 30 % of its calls (two attempts in three, with 3
// attempts a call) makes a run of 5 every few hundred calls, and with 5 in
// a row as the rule, a client making 600 calls a second had its breaker
// open for 500ms about every second: 29 % of calls through, against 70 %
// with no breaker. A run that lasts a second at that rate is 600 failed
// calls: no such server makes it, and one from which nothing succeeds
// makes it in a second. A slow client still needs the count: 5 failures
// a minute apart open the breaker after 4 minutes, not 1 s.
//
// Open refuses every call at once with an [*OpenError] that wraps [ErrOpen] and
// carries codes.Unavailable. After OpenTimeout it is half-open: at most
// HalfOpenMaxRequests probe calls go through, each told it is a probe (the
// interceptor makes a probe a single attempt). If they all succeed it closes;
// a failed probe opens it again, for twice as long as the last time, up to
// MaxOpenTimeout (Envoy's outlier ejection grows its ejection time the same
// way): a blip costs a short refusal, a server that stays down is asked
// less and less often. Closing resets the period to OpenTimeout.
//
// # Defaults
//
//	ConsecutiveFailures  5, in a run that has lasted DownAfter
//	DownAfter            1s (none when ConsecutiveFailures is set)
//	FailureRatio         0 (off)
//	MinRequests          10 (with FailureRatio)
//	Window               10s, rolled in 10 buckets
//	OpenTimeout          500ms, doubled by each failed probe
//	MaxOpenTimeout       10s
//	HalfOpenMaxRequests  1
//	Scope                PerTarget
//
// # Cost
//
// A healthy breaker takes no lock. With FailureRatio off, only a run of
// consecutive failures can trip a closed breaker, and a success only ends
// such a run; so while the breaker is closed and no failure is on its run, a
// call skips gobreaker and only a failure is handed to it (and a success,
// when another call's failure began while it ran). Every transition and
// every failure count stays gobreaker's own; [Breaker.Counts] then leaves
// out the skipped successes and ignored calls. With FailureRatio set,
// every call goes through gobreaker, whose counts the ratio needs.
//
// # A fleet
//
// With [Settings.Fleet], the replicas of a service that name the same scope
// share one breaker through a store (module
// github.com/herdguard/herdguard/redisfleet keeps it in Redis): the fleet's
// run of consecutive failures opens it for every replica, and its half-open
// probes are leased fleet-wide. A call reads the fleet's state with one
// atomic load, and must pass the replica's own breaker too. See [Fleet].
//
// Time comes from the time package, as in gobreaker; tests drive it with
// testing/synctest.
package breaker
