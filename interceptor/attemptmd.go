package interceptor

import (
	"context"
	"strconv"

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
// is the outgoing metadata "herdguard-attempt: n". They are made once and
// never changed.
var attemptNumbers = func() (c [11]context.Context) {
	for n := 2; n < len(c); n++ {
		c[n] = attemptNumberContext(n)
	}
	return c
}()

func attemptNumberContext(n int) context.Context {
	return metadata.NewOutgoingContext(context.Background(), metadata.MD{AttemptMetadataKey: attemptValue(n)})
}

// attemptContext is a caller's context that carries no outgoing metadata,
// with the attempt number added as its outgoing metadata: the metadata is
// looked up in number, every other value in the caller's context.
type attemptContext struct {
	context.Context
	number context.Context // one of attemptNumbers
}

// Value returns the attempt number's outgoing metadata for gRPC's key, and
// the caller's value for any other key.
func (c *attemptContext) Value(key any) any {
	if v := c.number.Value(key); v != nil {
		return v
	}
	return c.Context.Value(key)
}

// retryMetadata numbers the retries of one unary call. One outgoing context
// serves every retry: gRPC reads the outgoing metadata as an attempt starts,
// and the number changes only once the attempt before has returned. If the
// caller sent no metadata of its own, that costs one allocation per call;
// otherwise the caller's metadata is copied once and numbered in place.
type retryMetadata struct {
	ctx context.Context
	own *attemptContext // the caller sent no metadata
	md  metadata.MD     // else: a copy of the caller's, which ctx carries
}

// numbered returns ctx with outgoing metadata that numbers attempt n (n >= 2).
func (r *retryMetadata) numbered(ctx context.Context, n int) context.Context {
	if r.ctx == nil {
		if md, ok := metadata.FromOutgoingContext(ctx); ok {
			r.md, r.ctx = md, metadata.NewOutgoingContext(ctx, md)
		} else {
			r.own = &attemptContext{Context: ctx}
			r.ctx = r.own
		}
	}
	if r.own == nil {
		r.md[AttemptMetadataKey] = attemptValue(n)
	} else if n < len(attemptNumbers) {
		r.own.number = attemptNumbers[n]
	} else {
		r.own.number = attemptNumberContext(n)
	}
	return r.ctx
}
