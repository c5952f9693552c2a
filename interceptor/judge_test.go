package interceptor

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/wire"
)

// judge classifies a failed attempt for retries and hedges alike, in
// gRPC's order: the caller's end first, then headers, the client's own
// error, a pushback that says stop, and the code last.
func TestJudge(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "down")
	stop := metadata.MD{wire.PushbackKey: {"-1"}}
	stopBelow := metadata.MD{wire.PushbackKey: {"-1"}, wire.GaveUpKey: {"overloaded"}}
	wait := metadata.MD{wire.PushbackKey: {"250"}}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tt := range []struct {
		name     string
		ctx      context.Context
		e        attemptEnd
		again    bool
		want     failure
		below    bool
		pushback time.Duration // -1: none
	}{
		{"again", context.Background(), attemptEnd{err: unavailable}, true, failAgain, false, -1},
		{"a code not tried again", context.Background(), attemptEnd{err: unavailable}, false, failFatal, false, -1},
		{"after the server's wait", context.Background(), attemptEnd{err: unavailable, trailer: wait}, true, failAgain, false, 250 * time.Millisecond},
		{"a pushback that says stop, whatever the code", context.Background(), attemptEnd{err: unavailable, trailer: stop}, false, failStop, false, -1},
		{"a layer below gave up", context.Background(), attemptEnd{err: unavailable, trailer: stopBelow}, true, failStop, true, -1},
		{"the client's own error before the pushback", context.Background(), attemptEnd{err: unavailable, trailer: stop, client: true}, true, failClient, false, -1},
		{"headers before the client's error", context.Background(), attemptEnd{err: unavailable, headers: true, client: true}, true, failCommitted, false, -1},
		{"committed, and a layer below gave up", context.Background(), attemptEnd{err: unavailable, headers: true, trailer: stopBelow}, true, failCommitted, true, -1},
		{"the caller's end first", cancelled, attemptEnd{err: unavailable, headers: true, trailer: stop}, true, failCaller, false, -1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			j := judge(tt.ctx, tt.e, tt.again)
			if j.fail != tt.want || j.gaveUpBelow != tt.below || j.again != tt.again {
				t.Errorf("judge = %+v, want fail %d, below %v, again %v", j, tt.want, tt.below, tt.again)
			}
			if got := j.pushback; got != (tt.pushback >= 0) || got && j.wait != tt.pushback {
				t.Errorf("pushback %v, wait %v; want %v", j.pushback, j.wait, tt.pushback)
			}
		})
	}
}
