package mesh_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/mesh"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

func unavailable(context.Context, int64) error { return status.Error(codes.Unavailable, "leaf: down") }

// TestTrailerOnEveryGiveUp sends one call through a middle tier that has
// both halves to a leaf, and checks the answer: "don't retry" (a pushback
// of -1 and the outcome) on every way a herdguard call below gives up, and
// on none of the others, with the handler's status code kept. Each row
// runs as a unary call and as a server stream that fails before it sends
// (the tier passes the stream on, so the stream halves answer).
func TestTrailerOnEveryGiveUp(t *testing.T) {
	hang := func(ctx context.Context, _ int64) error {
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	}
	tests := []struct {
		name   string
		answer func(ctx context.Context, n int64) error
		opts   []interceptor.Option
		mopts  []mesh.Option // the client half's
		wrap   func(error) error
		// prime calls are made first, through the same middle tier.
		prime    int
		incoming metadata.MD
		timeout  time.Duration
		code     codes.Code
		gaveUp   string // "": no trailer
		attempts int64  // the leaf's attempts, prime calls included (0: not checked)
	}{
		{name: "ok", answer: func(context.Context, int64) error { return nil }, code: codes.OK, attempts: 1},
		// A server below that fails on its own gets the retries from above
		// it would get without the server half: out of attempts says
		// "don't retry" only while the overload controller paces it.
		{name: "out of attempts", answer: unavailable, code: codes.Unavailable, attempts: 3},
		{name: "out of attempts, overloaded", answer: unavailable, opts: pacingAfterTwo,
			prime: 7, code: codes.Unavailable, gaveUp: "exhausted", attempts: 24},
		{name: "out of attempts, overloaded, status rewritten by the handler", answer: unavailable, opts: pacingAfterTwo,
			wrap:  func(err error) error { return status.Errorf(codes.Internal, "charge: %v", err) },
			prime: 7, code: codes.Internal, gaveUp: "exhausted", attempts: 24},
		{name: "stopping pushback", answer: func(ctx context.Context, _ int64) error {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("grpc-retry-pushback-ms", "-1"))
			return status.Error(codes.Unavailable, "leaf: overloaded; don't retry")
		}, code: codes.Unavailable, gaveUp: "pushback_stop", attempts: 1},
		{name: "out of budget", answer: unavailable,
			opts: []interceptor.Option{interceptor.WithRetryThrottling(policy.Throttling{MaxTokens: 1, TokenRatio: 0.1})},
			code: codes.Unavailable, gaveUp: "budget_exhausted", attempts: 1},
		{name: "open breaker", answer: unavailable,
			opts:  []interceptor.Option{interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: time.Minute})},
			prime: 1, code: codes.Unavailable, gaveUp: "breaker_open", attempts: 3},
		// A retry above limits the calls below to one attempt only where
		// the tier judges the leaf overloaded.
		{name: "a retry above, nothing judged overloaded: every attempt below", answer: unavailable,
			incoming: metadata.Pairs("grpc-previous-rpc-attempts", "1"),
			code:     codes.Unavailable, attempts: 3},
		{name: "a retry above: one attempt below, overloaded", answer: unavailable, opts: pacingAfterTwo, prime: 7,
			incoming: metadata.Pairs("grpc-previous-rpc-attempts", "1"),
			code:     codes.Unavailable, gaveUp: mesh.OutcomeRetriedAbove, attempts: 22},
		{name: "not retryable", answer: func(context.Context, int64) error { return status.Error(codes.InvalidArgument, "leaf: bad amount") },
			code: codes.InvalidArgument, attempts: 1},
		{name: "a retry above (go-grpc-middleware's mark): one attempt below", answer: unavailable, opts: pacingAfterTwo, prime: 7,
			incoming: metadata.Pairs("x-retry-attempt", "1"),
			code:     codes.Unavailable, gaveUp: mesh.OutcomeRetriedAbove, attempts: 22},
		{name: "a first send with go-grpc-middleware's mark", answer: unavailable, opts: pacingAfterTwo, prime: 7,
			incoming: metadata.Pairs("x-retry-attempt", "0"),
			code:     codes.Unavailable, gaveUp: "exhausted", attempts: 24},
		// The prime call is unary; the breaker is the target's, so a
		// stream is refused by it as it opens.
		{name: "a retry above, open breaker below: named as it is", answer: unavailable,
			opts:  []interceptor.Option{interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: time.Minute})},
			prime: 1, incoming: metadata.Pairs("grpc-previous-rpc-attempts", "1"),
			code: codes.Unavailable, gaveUp: "breaker_open", attempts: 3},
		{name: "a retry above, a code the policy retries", answer: aborted,
			opts:     []interceptor.Option{interceptor.WithPolicy(retrying(codes.Aborted))},
			incoming: metadata.Pairs("herdguard-attempt", "2"), code: codes.Aborted, attempts: 3},
		// Twenty refusals (not retried: the policy retries Aborted only;
		// a fresh controller judges 20 attempts within its first
		// Interval) make the middle tier pace the leaf.
		{name: "a retry above, a code the policy retries, overloaded", answer: func(_ context.Context, n int64) error {
			if n <= 20 {
				return status.Error(codes.Unavailable, "leaf: overloaded")
			}
			return status.Error(codes.Aborted, "leaf: conflict")
		},
			opts:  append([]interceptor.Option{interceptor.WithPolicy(retrying(codes.Aborted))}, pacingAfterTwo...),
			prime: 20, incoming: metadata.Pairs("herdguard-attempt", "2"), code: codes.Aborted, gaveUp: mesh.OutcomeRetriedAbove, attempts: 21},
		{name: "a retry above, a code only the default policy retries", answer: unavailable,
			opts:     []interceptor.Option{interceptor.WithPolicy(retrying(codes.Aborted))},
			incoming: metadata.Pairs("herdguard-attempt", "2"), code: codes.Unavailable, attempts: 1},
		{name: "a retry above, a code the default policy does not retry", answer: aborted,
			incoming: metadata.Pairs("herdguard-attempt", "2"), code: codes.Aborted, attempts: 1},
		{name: "a retry above, not retryable", answer: func(context.Context, int64) error { return status.Error(codes.InvalidArgument, "leaf: bad amount") },
			incoming: metadata.Pairs("herdguard-attempt", "2"), code: codes.InvalidArgument, attempts: 1},
		{name: "out of time: the reserve", answer: hang, mopts: []mesh.Option{mesh.WithDeadlineReserve(200 * time.Millisecond)},
			timeout: time.Second, code: codes.DeadlineExceeded, gaveUp: "deadline", attempts: 1},
		{name: "deadline, no reserve", answer: hang, mopts: []mesh.Option{mesh.WithDeadlineReserve(0)},
			timeout: 100 * time.Millisecond, code: codes.DeadlineExceeded, attempts: 1},
		{name: "failed after commit", answer: func(ctx context.Context, _ int64) error {
			_ = grpc.SendHeader(ctx, metadata.Pairs("leaf", "committed"))
			return status.Error(codes.Unavailable, "leaf: failed after headers")
		}, code: codes.Unavailable, attempts: 1},
		{name: "succeeded on a retry", answer: func(_ context.Context, n int64) error {
			if n < 3 {
				return status.Error(codes.Unavailable, "leaf: down")
			}
			return nil
		}, code: codes.OK, attempts: 3},
	}
	for _, tt := range tests {
		for _, kind := range []string{"stream", "unary"} { // the stream first: its own answers must mark the upper tier
			t.Run(tt.name+", "+kind, func(t *testing.T) {
				l := &leaf{answer: tt.answer}
				opts := append([]interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker(), interceptor.WithoutOverloadControl()}, tt.opts...)
				mid := &tier{next: dial(t, serve(t, l), mesh.DialOptions(herdguard(t, opts...), tt.mopts...)...), wrap: tt.wrap}
				user := plain(t, serve(t, mid, mesh.ServerOptions()...))
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				for range tt.prime {
					_, _ = user.Charge(ctx, &demov1.ChargeRequest{})
				}
				if tt.timeout > 0 {
					var c context.CancelFunc
					ctx, c = context.WithTimeout(ctx, tt.timeout)
					defer c()
				}
				if tt.incoming != nil {
					ctx = metadata.NewOutgoingContext(ctx, tt.incoming)
				}
				var trailer metadata.MD
				var err error
				if kind == "unary" {
					_, err = user.Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
				} else {
					trailer, err = drain(ctx, user)
				}
				if got := status.Code(err); got != tt.code {
					t.Errorf("code %v (%v), want %v", got, err, tt.code)
				}
				checkTrailer(t, trailer, tt.gaveUp)
				if got := l.attempts.Load(); tt.attempts > 0 && got != tt.attempts {
					t.Errorf("the leaf received %d attempts, want %d", got, tt.attempts)
				}
			})
		}
	}
}

// primeCalls is how many calls of 3 refused attempts make a tier with
// pacingAfterTwo judge its leaf overloaded.
const primeCalls = 7

// primeOverload makes primeCalls calls through user, whose middle tier
// runs pacingAfterTwo against a leaf that refuses everything.
func primeOverload(user demov1.GatewayServiceClient) {
	for range primeCalls {
		_, _ = user.Charge(context.Background(), &demov1.ChargeRequest{})
	}
}

// pacingAfterTwo is overload control that paces a server after two
// refusals: 7 prime calls (21 refused attempts, more than a fresh
// controller needs to judge within its first Interval) make the middle
// tier judge the leaf overloaded; it stays so for a minute of calm.
var pacingAfterTwo = []interceptor.Option{interceptor.WithOverloadControl(overload.Settings{Interval: time.Millisecond, MinFailures: 2, Calm: 60_000})}

func aborted(context.Context, int64) error { return status.Error(codes.Aborted, "leaf: conflict") }

// retrying is fast(3) retrying only the given codes.
func retrying(cs ...codes.Code) policy.Policy {
	p := fast(3)
	p.RetryableCodes = cs
	return p
}

// drain opens a ListCharges stream through c and receives until it ends:
// its trailer and error (nil for a clean end).
func drain(ctx context.Context, c demov1.GatewayServiceClient, opts ...grpc.CallOption) (metadata.MD, error) {
	cs, err := c.ListCharges(ctx, &demov1.ListChargesRequest{}, opts...)
	if err != nil {
		return nil, err
	}
	for {
		if _, err = cs.Recv(); err != nil {
			break
		}
	}
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return cs.Trailer(), err
}

// checkTrailer checks that trailer says "don't retry" once, because of
// gaveUp, or, for "", says nothing of the kind.
func checkTrailer(t *testing.T, trailer metadata.MD, gaveUp string) {
	t.Helper()
	push, why := trailer.Get("grpc-retry-pushback-ms"), trailer.Get(mesh.GaveUpTrailerKey)
	if gaveUp == "" {
		if len(push) > 0 || len(why) > 0 {
			t.Errorf("trailer %v: want no pushback and no %s", trailer, mesh.GaveUpTrailerKey)
		}
		return
	}
	if len(push) != 1 || push[0] != "-1" || len(why) != 1 || why[0] != gaveUp {
		t.Errorf("trailer %v (%s %v): want grpc-retry-pushback-ms [-1] and %s [%s]", trailer, mesh.GaveUpTrailerKey, why, mesh.GaveUpTrailerKey, gaveUp)
	}
}

// TestTrailerOnShed: a call the overload controller sheds gives up. The
// leaf refuses everything, so the controller soon judges it down and sheds
// every call but a probe now and then (a trigger needs only 2 refusals
// here, and a short DownAfter lets the serial caller judge it down within
// the test).
func TestTrailerOnShed(t *testing.T) {
	l := &leaf{answer: unavailable}
	ic := herdguard(t, interceptor.WithPolicy(fast(1)), interceptor.WithoutBreaker(),
		interceptor.WithOverloadControl(overload.Settings{Interval: 10 * time.Millisecond, MinFailures: 2, DownAfter: 100 * time.Millisecond}))
	mid := &tier{next: dial(t, serve(t, l), mesh.DialOptions(ic)...)}
	user := plain(t, serve(t, mid, mesh.ServerOptions()...))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		var trailer metadata.MD
		_, err := user.Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
		if why := trailer.Get(mesh.GaveUpTrailerKey); len(why) == 1 && why[0] == "shed" {
			if status.Code(err) != codes.Unavailable {
				t.Errorf("shed call: %v, want Unavailable", err)
			}
			checkTrailer(t, trailer, "shed")
			return
		}
		time.Sleep(time.Millisecond) // a call per millisecond, so that intervals pass
	}
	t.Fatal("no call was shed within 20 s against a leaf that refuses everything")
}

// TestServerHalfAlone: a handler whose connection below has herdguard but
// not the client half still answers "don't retry" when it returns the
// give-up's error (wrapped or not), through the server interceptor alone;
// one that rewrites the error into a new status loses it, as the package
// says.
func TestServerHalfAlone(t *testing.T) {
	tests := []struct {
		name   string
		wrap   func(error) error
		gaveUp string
	}{
		{"returned as it is", nil, "exhausted"},
		{"wrapped", func(err error) error { return fmt.Errorf("charge: %w", err) }, "exhausted"},
		{"rewritten", func(err error) error { return status.Error(codes.Internal, err.Error()) }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ic := herdguard(t, append([]interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker()}, pacingAfterTwo...)...)
			mid := &tier{next: dial(t, serve(t, &leaf{answer: unavailable}), ic.DialOptions()...), wrap: tt.wrap}
			user := plain(t, serve(t, mid, mesh.ServerOptions()...))
			primeOverload(user)
			var trailer metadata.MD
			_, err := user.Charge(context.Background(), &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
			if err == nil {
				t.Fatal("the call succeeded against a leaf that refuses everything")
			}
			checkTrailer(t, trailer, tt.gaveUp)
		})
	}
}

// TestServerHalfOrder: the server half alone sees the error the
// interceptors chained after it return. Chained last, after an interceptor
// that rewrites errors into new statuses, it sees the handler's give-up
// and says "don't retry", and the rewrite keeps the trailer; chained
// before that interceptor it sees only the rewritten status, as the docs
// warn.
func TestServerHalfOrder(t *testing.T) {
	rewrite := grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		if err != nil {
			err = status.Error(codes.Internal, "charge failed")
		}
		return resp, err
	})
	tests := []struct {
		name   string
		opts   func() []grpc.ServerOption
		gaveUp string
	}{
		{"the server half last", func() []grpc.ServerOption { return append([]grpc.ServerOption{rewrite}, mesh.ServerOptions()...) }, "exhausted"},
		{"the server half first", func() []grpc.ServerOption { return append(mesh.ServerOptions(), rewrite) }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ic := herdguard(t, append([]interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker()}, pacingAfterTwo...)...)
			mid := &tier{next: dial(t, serve(t, &leaf{answer: unavailable}), ic.DialOptions()...)}
			user := plain(t, serve(t, mid, tt.opts()...))
			primeOverload(user)
			var trailer metadata.MD
			_, err := user.Charge(context.Background(), &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
			if status.Code(err) != codes.Internal {
				t.Fatalf("%v, want the rewritten Internal", err)
			}
			checkTrailer(t, trailer, tt.gaveUp)
		})
	}
}

// TestStreamsBeforeAndAfterCommit: a server stream below that fails before
// it has sent anything is retried and gives up; one that fails after a
// message has committed, and was not retried: only the first says "don't
// retry". The tier serves a stream, so the server half's stream
// interceptor answers.
func TestStreamsBeforeAndAfterCommit(t *testing.T) {
	tests := []struct {
		name     string
		stream   func(ss grpc.ServerStreamingServer[demov1.ListChargesResponse], n int64) error
		received int
		gaveUp   string
		attempts int64
		prime    bool // make the tier judge the leaf overloaded first
	}{
		{"before commit", func(grpc.ServerStreamingServer[demov1.ListChargesResponse], int64) error {
			return status.Error(codes.Unavailable, "leaf: down")
		}, 0, "exhausted", 3 * (primeCalls + 1), true},
		{"after commit", func(ss grpc.ServerStreamingServer[demov1.ListChargesResponse], _ int64) error {
			if err := ss.Send(&demov1.ListChargesResponse{ChargeId: "c1"}); err != nil {
				return err
			}
			return status.Error(codes.Unavailable, "leaf: down after a message")
		}, 1, "", 1, false},
	}
	for _, tt := range tests {
		for _, half := range []string{"client half", "server half alone"} {
			t.Run(tt.name+", "+half, func(t *testing.T) {
				l := &leaf{stream: tt.stream}
				ic := herdguard(t, append([]interceptor.Option{interceptor.WithPolicy(fast(3)), interceptor.WithoutBreaker()}, pacingAfterTwo...)...)
				dopts := mesh.DialOptions(ic)
				if half == "server half alone" {
					dopts = ic.DialOptions()
				}
				mid := &tier{next: dial(t, serve(t, l), dopts...)}
				user := plain(t, serve(t, mid, mesh.ServerOptions()...))
				for i := 0; tt.prime && i < primeCalls; i++ {
					_, _ = drain(context.Background(), user)
				}
				cs, err := user.ListCharges(context.Background(), &demov1.ListChargesRequest{})
				if err != nil {
					t.Fatal(err)
				}
				got := 0
				for {
					_, err = cs.Recv()
					if err != nil {
						break
					}
					got++
				}
				if errors.Is(err, io.EOF) || status.Code(err) != codes.Unavailable {
					t.Errorf("stream ended with %v, want Unavailable", err)
				}
				if got != tt.received {
					t.Errorf("received %d messages, want %d", got, tt.received)
				}
				checkTrailer(t, cs.Trailer(), tt.gaveUp)
				if n := l.attempts.Load(); n != tt.attempts {
					t.Errorf("the leaf received %d attempts, want %d", n, tt.attempts)
				}
			})
		}
	}
}

// TestHeldBelowPassesUp: while a tier's overload controller paces its
// target, the client half marks the answers to the requests the tier
// serves as held back below (herdguard-held-below), and a herdguard tier
// above, whose answers then come from that line, passes the mark on with
// its own answers: no layer above takes the wait in that line for a queue
// at its own target, which would hold its calls back too. The leaf
// refuses its first 50 attempts, which start the lower tier's pacing, and
// answers after; the upper tier, calm, marks its answers only once the
// lower tier's come marked, for a stream's answers as for a unary call's.
func TestHeldBelowPassesUp(t *testing.T) {
	var refusals atomic.Int64
	l := &leaf{answer: func(ctx context.Context, n int64) error {
		if refusals.Add(1) <= 50 {
			return unavailable(ctx, n)
		}
		return nil
	}}
	paced := overload.Settings{Interval: 10 * time.Millisecond, MinFailures: 2}
	low := herdguard(t, interceptor.WithPolicy(fast(1)), interceptor.WithoutBreaker(), interceptor.WithOverloadControl(paced))
	mid := serve(t, &tier{next: dial(t, serve(t, l), mesh.DialOptions(low)...)}, mesh.ServerOptions()...)
	high := herdguard(t, interceptor.WithPolicy(fast(1)), interceptor.WithoutBreaker())
	top := serve(t, &tier{next: dial(t, mid, mesh.DialOptions(high)...)}, mesh.ServerOptions()...)
	held := func(md metadata.MD) bool { return len(md.Get("herdguard-held-below")) > 0 }
	// call makes one call of the kind, and returns its error and trailer.
	call := func(ctx context.Context, c demov1.GatewayServiceClient, kind string) (error, metadata.MD) {
		if kind == "unary" {
			var trailer metadata.MD
			_, err := c.Charge(ctx, &demov1.ChargeRequest{}, grpc.Trailer(&trailer))
			return err, trailer
		}
		cs, err := c.ListCharges(ctx, &demov1.ListChargesRequest{})
		if err != nil {
			return err, nil
		}
		for err == nil {
			_, err = cs.Recv()
		}
		if err == io.EOF {
			err = nil
		}
		return err, cs.Trailer()
	}
	answeredHeld := func(c demov1.GatewayServiceClient, kind, what string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		for ctx.Err() == nil {
			if err, trailer := call(ctx, c, kind); err == nil && held(trailer) {
				return
			}
			time.Sleep(time.Millisecond) // a call per millisecond, so that intervals pass
		}
		t.Fatalf("%s: no %s answer came back marked as held below within 20 s", what, kind)
	}

	if err, trailer := call(context.Background(), plain(t, top), "unary"); held(trailer) {
		t.Fatalf("first call, every tier calm: %v, marked as held below", err)
	}
	answeredHeld(plain(t, mid), "unary", "the lower tier, while it paces the leaf")
	for _, kind := range []string{"stream", "unary"} { // the stream first: its own answers must mark the upper tier
		answeredHeld(plain(t, top), kind, "the upper tier, calm, above the lower tier's line")
	}
}
