package mesh

import (
	"context"
	"errors"

	"google.golang.org/grpc"
)

// ServerOptions returns the server half's interceptors as server options:
// grpc.NewServer(mesh.ServerOptions()...). They chain, so they go beside
// otelgrpc's stats handler and other interceptors. The server half sees the
// error the interceptors after it return: chain it last, for one of those
// that rewrites an error into a new status hides the give-up from it,
// unless the client half, which signals from the call below, is installed
// too.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(StreamServerInterceptor()),
	}
}

// UnaryServerInterceptor returns the server half for unary handlers. When
// the handler fails with an error that wraps a herdguard give-up (GaveUp)
// the client half did not already report (a connection without
// DialOptions, or a call made with a context of its own), the answer says
// "don't retry". The handler's status is returned as it is. A handler that
// succeeds costs one comparison.
func UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if err != nil {
			failed(ctx, err)
		}
		return resp, err
	}
}

// StreamServerInterceptor returns the server half for stream handlers; see
// UnaryServerInterceptor.
func StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		err := handler(srv, ss)
		if err != nil {
			failed(ss.Context(), err)
		}
		return err
	}
}

// failed signals "don't retry" for a handler's err that wraps a give-up no
// client half signalled.
func failed(ctx context.Context, err error) {
	var s signalled
	if errors.As(err, &s) {
		return
	}
	if outcome, ok := GaveUp(err); ok {
		signal(ctx, string(outcome))
	}
}
