// Package names holds the names of the span attributes and events that
// herdguard writes and nobody is expected to query; the names a user
// queries are package telemetry's.
package names

import "go.opentelemetry.io/otel/attribute"

// Span attributes and events.
const (
	AttrBackoffDelayMS = attribute.Key("herdguard.backoff.delay_ms")
	AttrBackoffJitter  = attribute.Key("herdguard.backoff.jitter")
	AttrHeldMS         = attribute.Key("herdguard.held.delay_ms") // how long an attempt was held back
	AttrBreakerState   = attribute.Key("herdguard.breaker.state")
	AttrBreakerProbe   = attribute.Key("herdguard.breaker.probe")

	AttrHedges      = attribute.Key("herdguard.hedges")       // hedges a call sent
	AttrHedgeWinner = attribute.Key("herdguard.hedge.winner") // the number of the attempt that answered

	AttrStreamSent             = attribute.Key("herdguard.stream.messages_sent")
	AttrStreamReceived         = attribute.Key("herdguard.stream.messages_received")
	AttrStreamReplayedMessages = attribute.Key("herdguard.stream.replayed_messages")
	AttrStreamReplayedBytes    = attribute.Key("herdguard.stream.replayed_bytes")
	AttrStreamOverflow         = attribute.Key("herdguard.stream.buffer_overflow")

	EventBreakerRejected    = "herdguard.breaker.rejected"
	EventBreakerStateChange = "herdguard.breaker.state_change"
)
