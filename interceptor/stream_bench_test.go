package interceptor

import (
	"context"
	"io"
	"testing"

	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/herdguard/herdguard/internal/testserver"
)

// grpcRetryConfig turns on gRPC's built-in retry for the test service.
const grpcRetryConfig = `{"methodConfig": [{"name": [{"service": "grpc.testing.TestService"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`

const streamMessages = 100

// streamPeers are the configurations the stream benchmarks compare.
func streamPeers(b *testing.B) map[string][]grpc.DialOption {
	ic, err := New(WithTracerProvider(noop.NewTracerProvider()))
	if err != nil {
		b.Fatal(err)
	}
	return map[string][]grpc.DialOption{
		"no-interceptor": nil,
		"grpc-retry":     {grpc.WithDefaultServiceConfig(grpcRetryConfig)},
		"herdguard":      ic.DialOptions(),
	}
}

// BenchmarkServerStream100 opens a stream and reads 100 messages; ns/op
// and allocs/op divided by 100 are the per-message figures.
func BenchmarkServerStream100(b *testing.B) {
	resp := &testgrpc.StreamingOutputCallResponse{Payload: payload("0123456789")}
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		for range streamMessages {
			if err := ss.Send(resp); err != nil {
				return err
			}
		}
		return nil
	}})
	for _, name := range []string{"no-interceptor", "grpc-retry", "herdguard"} {
		b.Run(name, func(b *testing.B) {
			c := srv.Client(b, streamPeers(b)[name]...)
			ctx := context.Background()
			req := &testgrpc.StreamingOutputCallRequest{}
			var m testgrpc.StreamingOutputCallResponse
			b.ReportAllocs()
			for b.Loop() {
				stream, err := c.StreamingOutputCall(ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				n := 0
				for {
					if err := stream.RecvMsg(&m); err != nil {
						if err != io.EOF {
							b.Fatal(err)
						}
						break
					}
					n++
				}
				if n != streamMessages {
					b.Fatalf("received %d messages", n)
				}
			}
		})
	}
}

// BenchmarkClientStream100 sends 100 messages and reads the answer. Every
// message is sent before the stream commits, so herdguard keeps each in the
// replay buffer.
func BenchmarkClientStream100(b *testing.B) {
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		n := 0
		for {
			if _, err := ss.Recv(); err != nil {
				if err == io.EOF {
					return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
				}
				return err
			}
			n++
		}
	}})
	for _, name := range []string{"no-interceptor", "grpc-retry", "herdguard"} {
		b.Run(name, func(b *testing.B) {
			c := srv.Client(b, streamPeers(b)[name]...)
			ctx := context.Background()
			req := &testgrpc.StreamingInputCallRequest{Payload: payload("0123456789")}
			b.ReportAllocs()
			for b.Loop() {
				stream, err := c.StreamingInputCall(ctx)
				if err != nil {
					b.Fatal(err)
				}
				for range streamMessages {
					if err := stream.Send(req); err != nil {
						b.Fatal(err)
					}
				}
				resp, err := stream.CloseAndRecv()
				if err != nil || resp.GetAggregatedPayloadSize() != streamMessages {
					b.Fatalf("%v, %v", resp, err)
				}
			}
		})
	}
}
