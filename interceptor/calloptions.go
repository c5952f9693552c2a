package interceptor

import (
	"github.com/herdguard/herdguard/internal/errs"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/policy"
)

// CallPolicy returns a call option that makes one call use p instead of the
// policy the interceptor would choose. Zero fields of p mean their defaults.
// p is validated here, once; an invalid p makes the call fail at once with
// codes.InvalidArgument and the validation error, sending nothing.
//
// Policies are chosen in this order: CallPolicy, then [WithMethodPolicy]
// for the method, then for its service, then [WithPolicy]. [NoRetry] makes
// any of them a single attempt.
//
// Like every herdguard call option it embeds grpc.EmptyCallOption, so it is
// harmless on a connection without the interceptor.
func CallPolicy(p policy.Policy) grpc.CallOption {
	o := &callPolicyOption{}
	if err := p.Validate(); err != nil {
		o.err = errs.Errorf("interceptor: CallPolicy: %w", err)
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

// splitOnFinish returns opts without the caller's grpc.OnFinish options,
// and their functions. gRPC calls them once per call, after its retries;
// passed to every attempt they would run once per attempt, with the failed
// attempts' errors. It allocates only when there are any.
func splitOnFinish(opts []grpc.CallOption) ([]grpc.CallOption, []func(error)) {
	n := 0
	for _, o := range opts {
		if _, ok := o.(grpc.OnFinishCallOption); ok {
			n++
		}
	}
	if n == 0 {
		return opts, nil
	}
	kept := make([]grpc.CallOption, 0, len(opts)-n)
	finish := make([]func(error), 0, n)
	for _, o := range opts {
		if f, ok := o.(grpc.OnFinishCallOption); ok {
			finish = append(finish, f.OnFinish)
		} else {
			kept = append(kept, o)
		}
	}
	return kept, finish
}

// finished runs a call's OnFinish functions with its final error.
func finished(finish []func(error), err error) {
	for _, f := range finish {
		f(err)
	}
}
