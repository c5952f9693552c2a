package mesh

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// served is the transport stream of a request being served, as far as
// config.below looks: that there is one.
type served struct{}

func (served) Method() string               { return "/herdguard.demo.v1.GatewayService/Charge" }
func (served) SetHeader(metadata.MD) error  { return nil }
func (served) SendHeader(metadata.MD) error { return nil }
func (served) SetTrailer(metadata.MD) error { return nil }

var _ grpc.ServerTransportStream = served{}

// TestReserve: the deadline a call below is sent with, for each reserve
// and each request: a twentieth of the time left by default, at most
// 3 ms; a fixed one when set; none when it is off, when the request has
// no deadline, or when the call is not made while serving one.
func TestReserve(t *testing.T) {
	tests := []struct {
		name    string
		opts    []Option
		left    time.Duration // 0: no deadline
		serving bool
		cut     time.Duration // how much earlier the call's deadline is; -1: not cut
	}{
		{name: "default, 1 s left", left: time.Second, serving: true, cut: 3 * time.Millisecond},
		{name: "default, 40 ms left", left: 40 * time.Millisecond, serving: true, cut: 2 * time.Millisecond},
		{name: "default, 1 min left", left: time.Minute, serving: true, cut: 3 * time.Millisecond},
		{name: "fixed", opts: []Option{WithDeadlineReserve(30 * time.Millisecond)}, left: time.Second, serving: true, cut: 30 * time.Millisecond},
		{name: "off", opts: []Option{WithDeadlineReserve(0)}, left: time.Second, serving: true, cut: -1},
		{name: "negative: off", opts: []Option{WithDeadlineReserve(-time.Second)}, left: time.Second, serving: true, cut: -1},
		{name: "no deadline", serving: true, cut: -1},
		{name: "not serving a request", left: time.Second, cut: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if tt.serving {
				ctx = grpc.NewContextWithServerTransportStream(ctx, served{})
			}
			if tt.left > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.left)
				defer cancel()
			}
			callCtx, cancel, cut := newConfig(tt.opts).below(ctx)
			defer cancel()
			if cut != (tt.cut >= 0) {
				t.Fatalf("cut %v, want %v", cut, tt.cut >= 0)
			}
			if !cut {
				if callCtx != ctx {
					t.Error("the call's context is not the request's")
				}
				return
			}
			dl, _ := ctx.Deadline()
			callDL, _ := callCtx.Deadline()
			// The default reads the clock once more: allow a millisecond's
			// share of the time that passed in between.
			if got := dl.Sub(callDL); got > tt.cut || got < tt.cut-time.Millisecond {
				t.Errorf("the call's deadline is %v before the request's, want %v", got, tt.cut)
			}
			cancel()
			if callCtx.Err() == nil || ctx.Err() != nil {
				t.Error("cancel did not end the call's context alone")
			}
		})
	}
}

// TestOutOfTime: a call below ran out of the time the reserve left it when
// it failed with DeadlineExceeded at its deadline, or so near it that the
// server below's copy ended first (within a tenth of the reserve), while
// the request being served still has time; not otherwise.
func TestOutOfTime(t *testing.T) {
	deadline := status.Error(codes.DeadlineExceeded, "context deadline exceeded")
	tests := []struct {
		name          string
		left, reserve time.Duration // the request's time left; its reserve
		cancelServed  bool
		err           error
		want          bool
	}{
		{name: "the call's deadline passed", left: 5 * time.Millisecond, reserve: time.Hour, err: deadline, want: true},
		{name: "a server below ended first, near the deadline", left: 102 * time.Millisecond, reserve: 100 * time.Millisecond, err: deadline, want: true},
		{name: "far from the deadline", left: time.Second, reserve: 100 * time.Millisecond, err: deadline},
		{name: "another code", left: 5 * time.Millisecond, reserve: time.Hour, err: status.Error(codes.Unavailable, "down")},
		{name: "the request is over", left: 5 * time.Millisecond, reserve: time.Hour, cancelServed: true, err: deadline},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			served, cancel := context.WithTimeout(context.Background(), tt.left)
			defer cancel()
			dl, _ := served.Deadline()
			call, cancelCall := context.WithDeadline(served, dl.Add(-tt.reserve))
			defer cancelCall()
			if tt.cancelServed {
				cancel()
			}
			if got := outOfTime(served, call, tt.err); got != tt.want {
				t.Errorf("outOfTime = %v, want %v", got, tt.want)
			}
		})
	}
}
