package interceptor

import (
	"context"

	"google.golang.org/grpc"
)

// Stream returns the stream client interceptor. Streams are not yet retried
// or guarded by the breaker: it hands every stream to the next streamer as
// it is.
func (ic *Interceptor) Stream() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		return streamer(ctx, desc, cc, method, opts...)
	}
}
