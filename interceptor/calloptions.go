package interceptor

import (
	"fmt"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/policy"
)

// CallPolicy returns a call option that makes one call use p instead of the
// policy the interceptor would choose. Zero fields of p mean their defaults.
// p is validated here, once; an invalid p makes the call fail at once with
// codes.InvalidArgument and the validation error, sending nothing.
//
// Like every herdguard call option it embeds grpc.EmptyCallOption, so it is
// harmless on a connection without the interceptor.
func CallPolicy(p policy.Policy) grpc.CallOption {
	o := &callPolicyOption{}
	if err := p.Validate(); err != nil {
		o.err = fmt.Errorf("interceptor: CallPolicy: %w", err)
	} else {
		o.p = newResolved(p)
	}
	return o
}

// NoRetry returns a call option that makes one call a single attempt. The
// circuit breaker still counts it, and still refuses it when open.
func NoRetry() grpc.CallOption { return noRetryOption{} }

type callPolicyOption struct {
	grpc.EmptyCallOption
	p   *resolved
	err error
}

type noRetryOption struct{ grpc.EmptyCallOption }

// CallStreamBuffer returns a call option that sets one stream's replay
// buffer limit, in bytes of encoded messages. 0 makes the stream commit at
// its first message; a negative n makes the call fail with
// codes.InvalidArgument, sending nothing.
func CallStreamBuffer(n int) grpc.CallOption { return streamBufferOption{n: n} }

type streamBufferOption struct {
	grpc.EmptyCallOption
	n int
}
