package interceptor_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

// A client with herdguard's defaults: retries with full jitter inside a
// per-target circuit breaker, an overload controller per target that paces
// attempts once the server shows overload, traced to the global provider.
// The server here, on 127.0.0.1, turns its first call away with
// Unavailable, as a restarting backend would: herdguard waits a jittered
// backoff (at most 100 ms) and tries again, and the caller sees one call
// that succeeded. In a service, target is the server's name
// ("dns:///payments.internal:443") and the credentials are real.
func Example() {
	target, backend, stop := serveFlaky()
	defer stop()

	ic, err := interceptor.New()
	if err != nil {
		log.Fatal(err) // every option is checked here
	}
	cc, err := grpc.NewClient(target,
		append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	client := testgrpc.NewTestServiceClient(cc) // call as usual

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
	fmt.Println("call:", err)
	fmt.Println("attempts the server saw:", backend.calls.Load())
	// Output:
	// call: <nil>
	// attempts the server saw: 2
}

// serveFlaky starts a flaky server on 127.0.0.1 and returns its target,
// the server, and how to stop it.
func serveFlaky() (target string, backend *flaky, stop func()) {
	backend = &flaky{}
	target, stop = serve(backend)
	return target, backend, stop
}

// serve starts a test service on 127.0.0.1 and returns its target and how
// to stop it.
func serve(backend testgrpc.TestServiceServer) (target string, stop func()) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(srv, backend)
	go srv.Serve(lis)
	return "passthrough:///" + lis.Addr().String(), srv.Stop
}

// Configuration is checked once, in New: an unusable value is an error that
// names the field and the value.
func ExampleNew_invalid() {
	_, err := interceptor.New(interceptor.WithPolicy(policy.Policy{Multiplier: 0.5}))
	fmt.Println(err)
	_, err = interceptor.New(interceptor.WithMethodPolicy("pkg.Svc/Method", policy.Default()))
	fmt.Println(err)
	// Output:
	// herdguard: interceptor: WithPolicy: policy: Multiplier = 0.5: must be 0 (default) or at least 1
	// herdguard: interceptor: WithMethodPolicy: method name "pkg.Svc/Method" must look like "/pkg.Service/Method" or "/pkg.Service/"
}

// Different methods can retry differently; a method's own policy wins over
// its service's. Here a server on 127.0.0.1 turns every call away with
// Unavailable: the service's policy makes 5 attempts of EmptyCall, while
// UnaryCall, which must not be retried, makes one and fails with the
// server's status as it came.
func ExampleWithMethodPolicy() {
	target, backend, stop := serveDown()
	defer stop()

	service := policy.Default()
	service.MaxAttempts = 5
	service.InitialBackoff = time.Millisecond
	once := policy.Default()
	once.MaxAttempts = 1 // never retry a payment without an idempotency key
	ic, err := interceptor.New(
		interceptor.WithMethodPolicy("/grpc.testing.TestService/", service),
		interceptor.WithMethodPolicy("/grpc.testing.TestService/UnaryCall", once),
		interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 10, OpenTimeout: 2 * time.Second}),
	)
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient(target,
		append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	client := testgrpc.NewTestServiceClient(cc)
	ctx := context.Background()

	_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
	fmt.Println(err)
	_, err = client.UnaryCall(ctx, &testgrpc.SimpleRequest{})
	fmt.Println(err)
	fmt.Println("attempts the server saw:", backend.calls.Load())
	// Output:
	// herdguard: gave up after 5 attempt(s); last: rpc error: code = Unavailable desc = down
	// rpc error: code = Unavailable desc = down
	// attempts the server saw: 6
}

// down answers every call Unavailable.
type down struct {
	testgrpc.UnimplementedTestServiceServer
	calls atomic.Int32
}

func (d *down) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	d.calls.Add(1)
	return nil, status.Error(codes.Unavailable, "down")
}

func (d *down) UnaryCall(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	d.calls.Add(1)
	return nil, status.Error(codes.Unavailable, "down")
}

// serveDown starts a down server on 127.0.0.1 and returns its target, the
// server, and how to stop it.
func serveDown() (target string, backend *down, stop func()) {
	backend = &down{}
	target, stop = serve(backend)
	return target, backend, stop
}

// A call option changes one call only.
func ExampleCallPolicy() {
	var client testgrpc.TestServiceClient // made with ic.DialOptions()
	if client == nil {
		return
	}
	urgent := policy.Policy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond} // the other fields are defaults: full jitter
	_, _ = client.UnaryCall(context.Background(), &testgrpc.SimpleRequest{}, interceptor.CallPolicy(urgent))
	_, _ = client.EmptyCall(context.Background(), &testgrpc.Empty{}, interceptor.NoRetry())
}

// A call that runs out of attempts fails loudly: the error says how many
// attempts were made and keeps the last status.
func ExampleRetryError() {
	err := error(&interceptor.RetryError{Attempts: 3, Outcome: interceptor.OutcomeExhausted,
		Err: status.Error(codes.Unavailable, "backend restarting")})
	var re *interceptor.RetryError
	fmt.Println(errors.As(err, &re), re.Attempts, status.Code(err))
	fmt.Println(err)
	// Output:
	// true 3 Unavailable
	// herdguard: gave up after 3 attempt(s); last: rpc error: code = Unavailable desc = backend restarting
}

// Streams of every kind are retried until they commit; the replay buffer
// (256 KiB by default) can be sized per interceptor or per call. Here the
// server fails the first client stream after reading it whole: herdguard
// opens a second and replays what the caller sent, and the caller sees one
// stream that succeeded.
func ExampleInterceptor_Stream() {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer()
	backend := &failFirstStream{}
	testgrpc.RegisterTestServiceServer(srv, backend)
	go srv.Serve(lis)
	defer srv.Stop()

	ic, err := interceptor.New(interceptor.WithStreamBuffer(64<<10),
		interceptor.WithPolicy(policy.Policy{InitialBackoff: time.Millisecond}))
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	client := testgrpc.NewTestServiceClient(cc)
	stream, err := client.StreamingInputCall(context.Background(), interceptor.CallStreamBuffer(1<<20))
	if err != nil {
		log.Fatal(err) // the breaker may refuse a stream at creation
	}
	for _, r := range []string{"a", "bc"} {
		if err := stream.Send(&testgrpc.StreamingInputCallRequest{Payload: &testgrpc.Payload{Body: []byte(r)}}); err != nil {
			log.Fatal(err)
		}
	}
	resp, err := stream.CloseAndRecv() // the failure before the answer replays "a", "bc"
	fmt.Println(resp.GetAggregatedPayloadSize(), "bytes,", err)
	fmt.Println("streams the server saw:", backend.streams.Load())
	// Output:
	// 3 bytes, <nil>
	// streams the server saw: 2
}

// failFirstStream reads each client stream whole, fails the first with
// Unavailable, and answers the others with the bytes they carried.
type failFirstStream struct {
	testgrpc.UnimplementedTestServiceServer
	streams atomic.Int32
}

func (f *failFirstStream) StreamingInputCall(s testgrpc.TestService_StreamingInputCallServer) error {
	n := 0
	for {
		m, err := s.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		n += len(m.GetPayload().GetBody())
	}
	if f.streams.Add(1) == 1 {
		return status.Error(codes.Unavailable, "restarting")
	}
	return s.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
}

// The breaker's Verdict says which failures count against a target: here one
// tenant's quota (ResourceExhausted) does not open the breaker for all.
func ExampleWithBreaker_verdict() {
	verdict := func(err error) herdguard.Verdict {
		if status.Code(err) == codes.ResourceExhausted {
			return herdguard.Ignored
		}
		return herdguard.BreakerVerdict(status.Code(err)) // the default table
	}
	ic, err := interceptor.New(interceptor.WithBreaker(breaker.Settings{Verdict: verdict}))
	fmt.Println(ic != nil, err)
	fmt.Println(verdict(status.Error(codes.ResourceExhausted, "tenant quota")), verdict(status.Error(codes.Unavailable, "down")))
	// Output:
	// true <nil>
	// ignored failure
}

// A service config drives herdguard's policies; give it to gRPC too for
// what herdguard does not read (waitForReady, size limits). DialOptions
// turns gRPC's own retry off, so the retryPolicy runs once, in herdguard.
func ExampleWithServiceConfig() {
	const sc = `{"methodConfig": [{
	  "name": [{"service": "shop.v1.Catalog"}],
	  "waitForReady": true,
	  "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
	    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	ic, err := interceptor.New(interceptor.WithServiceConfig(sc))
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient("dns:///catalog.internal:443", append(ic.DialOptions(),
		grpc.WithDefaultServiceConfig(sc), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	fmt.Println("ready")
	// Output: ready
}

// A hedged method: a second copy of a call goes once the first is slower
// than the method's recent p95 (never sooner than 10ms), and the first
// answer wins; the other attempt is cancelled. Here the server, on
// 127.0.0.1, never answers its first call, as a stuck replica would: the
// hedge answers it. A policy that both retries and hedges is refused.
func ExampleWithMethodPolicy_hedging() {
	target, backend, stop := serveStuckFirst()
	defer stop()

	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Quantile: 0.95, Delay: 10 * time.Millisecond}}
	ic, err := interceptor.New(
		interceptor.WithMethodPolicy("/grpc.testing.TestService/EmptyCall", hedged),
		interceptor.WithHedgeBudget(policy.Budget{Ratio: 0.05}), // hedges: 5 % of successes, plus 1/s
	)
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient(target,
		append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = testgrpc.NewTestServiceClient(cc).EmptyCall(ctx, &testgrpc.Empty{})
	fmt.Println("call:", err)
	<-backend.cancelled // the stuck first attempt was cancelled once the hedge won
	fmt.Println("attempts the server saw:", backend.calls.Load())

	both := hedged
	both.MaxAttempts = 3
	_, err = interceptor.New(interceptor.WithMethodPolicy("/shop.v1.Catalog/Get", both))
	fmt.Println(err)
	// Output:
	// call: <nil>
	// attempts the server saw: 2
	// herdguard: interceptor: WithMethodPolicy("/shop.v1.Catalog/Get"): policy: MaxAttempts = 3: set beside Hedging: a call is retried or hedged, never both (gRFC A6); leave the retry fields zero
}

// stuckFirst never answers its first call: it waits until the caller
// cancels it. It answers the others at once.
type stuckFirst struct {
	testgrpc.UnimplementedTestServiceServer
	calls     atomic.Int32
	cancelled chan struct{} // closed once the first call was cancelled
}

func (s *stuckFirst) EmptyCall(ctx context.Context, _ *testgrpc.Empty) (*testgrpc.Empty, error) {
	if s.calls.Add(1) == 1 {
		<-ctx.Done()
		close(s.cancelled)
		return nil, ctx.Err()
	}
	return &testgrpc.Empty{}, nil
}

// serveStuckFirst starts a stuckFirst server on 127.0.0.1 and returns its
// target, the server, and how to stop it.
func serveStuckFirst() (target string, backend *stuckFirst, stop func()) {
	backend = &stuckFirst{cancelled: make(chan struct{})}
	target, stop = serve(backend)
	return target, backend, stop
}

// gRFC A6's hedgingPolicy, from a service config.
func ExampleWithServiceConfig_hedging() {
	ic, err := interceptor.New(interceptor.WithServiceConfig(`{"methodConfig": [{
		"name": [{"service": "shop.v1.Catalog", "method": "Get"}],
		"hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.02s", "nonFatalStatusCodes": ["UNAVAILABLE"]}
	}]}`))
	fmt.Println(ic != nil, err)
	_, err = interceptor.New(interceptor.WithServiceConfig(`{"methodConfig": [{
		"name": [{"service": "shop.v1.Catalog"}],
		"hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "0.02s", "nonFatalStatusCodes": ["unavailable"]}
	}]}`))
	fmt.Println(err)
	// Output:
	// true <nil>
	// herdguard: interceptor: WithServiceConfig: policy: service config: methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0] = "unavailable": want an upper-case name such as "UNAVAILABLE" or a number from 0 to 16, as gRPC reads it: invalid code: "\"unavailable\""
}

// The overload controller is on by default. Tune it, for a server whose
// refusals come in larger numbers before they mean overload, or turn it
// off; a call it shed ends with OutcomeShed.
func ExampleWithOverloadControl() {
	ic, err := interceptor.New(interceptor.WithOverloadControl(overload.Settings{
		Interval:    250 * time.Millisecond,
		MinFailures: 50,
	}))
	if err != nil {
		log.Fatal(err)
	}
	_ = ic
	// ... a call through ic fails with:
	err = &interceptor.RetryError{Attempts: 1, Outcome: interceptor.OutcomeShed, Err: status.Error(codes.Unavailable, "down")}
	var re *interceptor.RetryError
	if errors.As(err, &re) && re.Outcome == interceptor.OutcomeShed {
		fmt.Println("shed by the overload controller, last status:", status.Code(err))
	}
	// Output: shed by the overload controller, last status: Unavailable
}

// A retry storm, as the log tells it. WithLogger logs each retry at Debug,
// and at Warn the breaker opening and each call herdguard gave up on. The
// server on 127.0.0.1 turns every call away: the first two calls make
// three attempts each, the second trips the breaker, and the third is
// refused without being sent. (The overload controller is off here, so
// that the log is the same on every run; the time, the target and the
// error's text are left out of it.)
func ExampleWithLogger() {
	target, _, stop := serveDown()
	defer stop()
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key {
			case slog.TimeKey, "herdguard.target", "herdguard.breaker.scope", "error":
				return slog.Attr{}
			}
			return a
		},
	}))
	ic, err := interceptor.New(
		interceptor.WithLogger(logger),
		interceptor.WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: time.Millisecond, Jitter: policy.NoJitter}),
		interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 2}),
		interceptor.WithoutOverloadControl(),
	)
	if err != nil {
		log.Fatal(err)
	}
	client, closeClient := dial(target, ic)
	defer closeClient()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for range 3 {
		_, _ = client.EmptyCall(ctx, &testgrpc.Empty{})
	}
	// Output:
	// level=DEBUG msg="herdguard: retrying" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.attempt=1 rpc.response.status_code=UNAVAILABLE wait=1ms reason=backoff
	// level=DEBUG msg="herdguard: retrying" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.attempt=2 rpc.response.status_code=UNAVAILABLE wait=2ms reason=backoff
	// level=WARN msg="herdguard: call failed" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.outcome=exhausted herdguard.attempts=3 rpc.response.status_code=UNAVAILABLE
	// level=DEBUG msg="herdguard: retrying" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.attempt=1 rpc.response.status_code=UNAVAILABLE wait=1ms reason=backoff
	// level=DEBUG msg="herdguard: retrying" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.attempt=2 rpc.response.status_code=UNAVAILABLE wait=2ms reason=backoff
	// level=WARN msg="herdguard: circuit breaker open" herdguard.breaker.from=closed herdguard.breaker.to=open consecutive_failures=2 failures=2 successes=0
	// level=WARN msg="herdguard: call failed" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.outcome=exhausted herdguard.attempts=3 rpc.response.status_code=UNAVAILABLE
	// level=WARN msg="herdguard: call failed" rpc.method=/grpc.testing.TestService/EmptyCall herdguard.outcome=breaker_open herdguard.attempts=0 rpc.response.status_code=UNAVAILABLE
}

// Hooks tell the caller's code what happens: here, a count of retries per
// method, the way go-grpc-middleware's WithOnRetryCallback or failsafe-go's
// OnRetry listener would keep it. The server turns every call away; each
// call makes 3 attempts, so 2 retries, and gives up.
func ExampleWithHooks() {
	target, _, stop := serveDown()
	defer stop()
	var retries, failed atomic.Int32
	ic, err := interceptor.New(
		interceptor.WithHooks(interceptor.Hooks{
			OnRetry:  func(_ context.Context, e interceptor.RetryEvent) { retries.Add(1) },
			OnGiveUp: func(_ context.Context, e interceptor.GiveUpEvent) { failed.Add(1) },
		}),
		interceptor.WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: time.Millisecond}),
		interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl(),
	)
	if err != nil {
		log.Fatal(err)
	}
	client, closeClient := dial(target, ic)
	defer closeClient()
	for range 2 {
		_, _ = client.EmptyCall(context.Background(), &testgrpc.Empty{})
	}
	fmt.Println("retries:", retries.Load(), "calls failed:", failed.Load())
	// Output:
	// retries: 4 calls failed: 2
}

// dial returns a client of target through ic, and how to close it.
func dial(target string, ic *interceptor.Interceptor) (testgrpc.TestServiceClient, func()) {
	cc, err := grpc.NewClient(target, append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	return testgrpc.NewTestServiceClient(cc), func() { cc.Close() }
}
