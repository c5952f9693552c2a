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
// Closed lets every call through and counts results. It opens on a trip
// condition: by default a run of 5 failed calls in a row that has lasted
// DownAfter (1 s) since its first failure, evidence that nothing succeeds,
// not chance (a server that fails a share of its calls on its own makes
// short runs by chance); an explicit ConsecutiveFailures trips on that many
// however quickly they came; a FailureRatio on that share of at least
// MinRequests calls in the Window. Open refuses every call at once with an
// [*OpenError] that wraps [ErrOpen] and carries codes.Unavailable. After
// OpenTimeout it is half-open: at most HalfOpenMaxRequests probes go
// through, each told it is a probe. If they all succeed it closes; a failed
// probe opens it again for twice as long, up to MaxOpenTimeout, as Envoy's
// outlier ejection does. [Settings] says what each field means and its
// default; the interceptor's package doc lists every default of herdguard.
//
// A healthy breaker takes no lock: while it is closed with no failure on
// its run, a call skips gobreaker and only a failure is handed to it (with
// FailureRatio set, every call is, as the ratio needs them all).
//
// With Settings.Fleet, the replicas of a service that name the same scope
// share one breaker through a store ([Fleet]; module
// github.com/herdguard/herdguard/redisfleet keeps it in Redis). What trips
// it, what a caller sees, and when to turn it off: docs/breaker.md
// (https://github.com/herdguard/herdguard/blob/main/docs/breaker.md).
package breaker
