package interceptor

import (
	"context"
	"strconv"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc/metadata"
)

// attemptValues are the metadata values of the first retries, made once.
var attemptValues = func() (v [11][]string) {
	for i := range v {
		v[i] = []string{strconv.Itoa(i)}
	}
	return v
}()

// attemptValue returns the metadata value that numbers attempt n.
func attemptValue(n int) []string {
	if n < len(attemptValues) {
		return attemptValues[n]
	}
	return []string{strconv.Itoa(n)}
}

// attemptNumbers holds, for the first retries, a context whose only content
// is the outgoing metadata "herdguard-attempt: n" and
// "grpc-previous-rpc-attempts: n-1". They are made once and never changed.
var attemptNumbers = func() (c [11]context.Context) {
	for n := 2; n < len(c); n++ {
		c[n] = attemptNumberContext(n)
	}
	return c
}()

func attemptNumberContext(n int) context.Context {
	return metadata.NewOutgoingContext(context.Background(), metadata.MD{wire.AttemptKey: attemptValue(n), wire.PreviousAttemptsKey: attemptValue(n - 1)})
}

// attemptContext is a caller's context that carries no outgoing metadata,
// with the attempt number added as its outgoing metadata: the metadata is
// looked up in number, every other value in the caller's context. Each is
// made for one attempt and never changed.
type attemptContext struct {
	context.Context
	number context.Context // one of attemptNumbers, or made like them
}

// Value returns the attempt number's outgoing metadata for gRPC's key, and
// the caller's value for any other key.
func (c *attemptContext) Value(key any) any {
	if v := c.number.Value(key); v != nil {
		return v
	}
	return c.Context.Value(key)
}

// retryNumbers numbers the retries of one call. If the caller sent no
// metadata of its own, each retry gets a context that answers gRPC's
// metadata lookup from one made once per attempt number; they are made up
// to four at a time, as many as the call may still need, so a call that
// retries up to four times allocates once. Each is set before its attempt
// and never changed after. If the caller sent
// metadata, each retry appends the number to it, never changing it in place.
type retryNumbers struct {
	checked, callerMD bool
	spare             []attemptContext
}

// context returns ctx numbered as attempt n (2 <= n <= maxAttempts).
func (r *retryNumbers) context(ctx context.Context, n, maxAttempts int) context.Context {
	if !r.checked {
		_, r.callerMD = metadata.FromOutgoingContext(ctx)
		r.checked = true
	}
	if r.callerMD {
		return metadata.AppendToOutgoingContext(ctx, wire.AttemptKey, attemptValue(n)[0], wire.PreviousAttemptsKey, attemptValue(n - 1)[0])
	}
	var number context.Context
	if n < len(attemptNumbers) {
		number = attemptNumbers[n]
	} else {
		number = attemptNumberContext(n)
	}
	if len(r.spare) == 0 {
		r.spare = make([]attemptContext, min(max(maxAttempts-n+1, 1), 4))
	}
	c := &r.spare[0]
	r.spare = r.spare[1:]
	c.Context, c.number = ctx, number
	return c
}
