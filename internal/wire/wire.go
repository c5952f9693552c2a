// Package wire holds the metadata keys herdguard's client and server
// halves write and read on the wire.
package wire

const (
	// AttemptKey carries the attempt number on every retry ("2", "3",
	// ...). The first attempt carries none, so a server can tell retries
	// from first sends.
	AttemptKey = "herdguard-attempt"

	// PreviousAttemptsKey carries, on every retry and hedge, how many
	// attempts of the call went before it ("1", "2", ...), as gRPC's own
	// retry sends it (gRFC A6): servers, stats handlers and proxies that
	// know gRPC read it.
	PreviousAttemptsKey = "grpc-previous-rpc-attempts"

	// PushbackKey is the trailer by which a server tells the client how
	// many milliseconds to wait before retrying (gRFC A6). A negative or
	// malformed value means: do not retry.
	PushbackKey = "grpc-retry-pushback-ms"

	// GaveUpKey is the trailer by which a server running herdguard's
	// server half (package mesh) says that a call it made below gave up,
	// beside a PushbackKey that says do not retry. A call stopped by such
	// an answer is Ignored by the breaker: the layer below already retried
	// and judged, its own protection acts there, and counting its give-ups
	// again here would open this layer's breaker on the evidence of
	// another's.
	GaveUpKey = "herdguard-gave-up"

	// HeldBelowKey is the trailer by which a server running herdguard's
	// server half (package mesh) says that a call it made below went
	// through an overload controller that paced its target: the answer
	// waited in that layer's line. A herdguard client above does not take
	// the wait for a queue at its own target (pacing.HeldBelow): the layer
	// below holds calls back already.
	HeldBelowKey = "herdguard-held-below"
)
