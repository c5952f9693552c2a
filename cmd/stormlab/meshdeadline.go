package stormlab

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

const (
	// UserDeadlineKey is the request metadata that carries the user's
	// deadline (Unix nanoseconds) down a chain of tiers, so that the leaf
	// can tell whether each attempt's own deadline is within it. The mesh
	// lab's user client sets it on every attempt, and every tier passes it
	// on as it is (passOn), beside RetriedAboveKey.
	UserDeadlineKey = "stormlab-user-deadline"
	// DeadlinesTrailerKey is the GetStats trailer that carries the
	// server's DeadlineCounts (see ReadLeafCounts).
	DeadlinesTrailerKey = "stormlab-deadlines"
	// RetriedAboveKey is the request metadata a tier adds to what it
	// sends on when the request it serves is a retry or a hedge of the
	// layer above (by the metadata each client sends: herdguard's attempt
	// number, gRPC's count of previous attempts, go-grpc-middleware's retry
	// number) or carries the mark itself. The leaf counts the attempts
	// that carry it: the load the retries above the leaf's caller add.
	RetriedAboveKey = "stormlab-retried-above"
	// RetriedAboveTrailerKey is the GetStats trailer that carries how many
	// attempts came with RetriedAboveKey (see ReadLeafCounts).
	RetriedAboveTrailerKey = "stormlab-retried-above"
)

// DeadlineSlack is how much later than the user's deadline an attempt's
// deadline may be and still count as within it. A deadline travels as the
// time left (grpc-timeout), which each hop's server adds to the time it
// reads the request, so a propagated deadline ends later by the time the
// request spent in transit, hop by hop: well under a millisecond on an
// idle loopback, over a hundred on a machine busy with a storm of retries
// (up to 124 ms measured on 2 cores, under go-grpc-middleware's and gRPC's
// retry at every layer, which send the leaf 10 attempts per user call). A
// tier that set a deadline of its own would be late by up to that deadline.
const DeadlineSlack = 250 * time.Millisecond

// DeadlineCounts are what a server saw of its attempts' deadlines since
// its last reset.
type DeadlineCounts struct {
	Stamped int64 // attempts that carried the user's deadline (UserDeadlineKey)
	None    int64 // attempts with no deadline at all
	// Late counts the stamped attempts whose deadline was later than the
	// user's by more than DeadlineSlack, or that had none.
	Late int64
	// MaxExcess is the most any stamped attempt's deadline was later than
	// the user's (negative if every one was earlier); 0 with none.
	MaxExcess time.Duration
}

// Within is the share of the stamped attempts whose deadline was within
// the user's (up to DeadlineSlack), in percent; 100 with none.
func (d DeadlineCounts) Within() float64 {
	if d.Stamped == 0 {
		return 100
	}
	return 100 * float64(d.Stamped-d.Late) / float64(d.Stamped)
}

func (d *DeadlineCounts) add(dl time.Time, has bool, user time.Time, stamped bool) {
	if !has {
		d.None++
	}
	if !stamped {
		return
	}
	excess := dl.Sub(user)
	if d.Stamped == 0 || excess > d.MaxExcess {
		d.MaxExcess = excess
	}
	d.Stamped++
	if !has || excess > DeadlineSlack {
		d.Late++
	}
}

// String is the trailer's form of d, read back by ParseDeadlineCounts.
func (d DeadlineCounts) String() string {
	return fmt.Sprintf("%d %d %d %d", d.Stamped, d.None, d.Late, int64(d.MaxExcess))
}

// ParseDeadlineCounts is the inverse of DeadlineCounts.String.
func ParseDeadlineCounts(v string) (DeadlineCounts, error) {
	var d DeadlineCounts
	var excess int64
	if _, err := fmt.Sscanf(v, "%d %d %d %d", &d.Stamped, &d.None, &d.Late, &excess); err != nil {
		return DeadlineCounts{}, fmt.Errorf("stormlab: deadline counts %q: %w", v, err)
	}
	d.MaxExcess = time.Duration(excess)
	return d, nil
}

// Deadlines returns what the server saw of its attempts' deadlines since
// its last reset.
func (s *Server) Deadlines() DeadlineCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

// RetriedAbove returns how many attempts since the last reset carried
// RetriedAboveKey: those a retry or hedge above the leaf's caller made.
func (s *Server) RetriedAbove() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.retriedAbove
}

// LeafCounts are what the mesh lab's leaf saw of its attempts, beside its
// GetStats counts.
type LeafCounts struct {
	Deadlines DeadlineCounts
	// RetriedAbove is the attempts that carried RetriedAboveKey: those
	// made for a retry or hedge of a layer above the leaf's caller.
	RetriedAbove int64
}

// ReadLeafCounts asks a demo server for its LeafCounts (the trailers of
// GetStats).
func ReadLeafCounts(ctx context.Context, ctl demov1.GatewayServiceClient) (LeafCounts, error) {
	var tr metadata.MD
	if _, err := ctl.GetStats(ctx, &demov1.GetStatsRequest{}, grpc.Trailer(&tr)); err != nil {
		return LeafCounts{}, err
	}
	d, a := tr.Get(DeadlinesTrailerKey), tr.Get(RetriedAboveTrailerKey)
	if len(d) == 0 || len(a) == 0 {
		return LeafCounts{}, fmt.Errorf("stormlab: the server sent no %s or %s trailer", DeadlinesTrailerKey, RetriedAboveTrailerKey)
	}
	var c LeafCounts
	var err error
	if c.Deadlines, err = ParseDeadlineCounts(d[0]); err != nil {
		return LeafCounts{}, err
	}
	if c.RetriedAbove, err = strconv.ParseInt(a[0], 10, 64); err != nil {
		return LeafCounts{}, fmt.Errorf("stormlab: %s %q: %w", RetriedAboveTrailerKey, a[0], err)
	}
	return c, nil
}

// UserDeadline returns the user's deadline that the request being served
// (ctx) carries in UserDeadlineKey, if it does.
func UserDeadline(ctx context.Context) (time.Time, bool) {
	v := metadata.ValueFromIncomingContext(ctx, UserDeadlineKey)
	if len(v) == 0 {
		return time.Time{}, false
	}
	ns, err := strconv.ParseInt(v[0], 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(0, ns), true
}

// StampUserDeadline is a client interceptor that sends each call's
// deadline, if it has one, in UserDeadlineKey: the mesh lab's user client
// installs it.
func StampUserDeadline() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if dl, ok := ctx.Deadline(); ok {
			ctx = metadata.AppendToOutgoingContext(ctx, UserDeadlineKey, strconv.FormatInt(dl.UnixNano(), 10))
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

// passOn returns ctx, the request a tier serves, with the user's deadline
// it carries (if any) added to its outgoing metadata, and RetriedAboveKey
// if the request is a retry or a hedge, or carries that mark.
func passOn(ctx context.Context) context.Context {
	var kv []string
	if v := metadata.ValueFromIncomingContext(ctx, UserDeadlineKey); len(v) > 0 {
		kv = append(kv, UserDeadlineKey, v[0])
	}
	if retriedAbove(ctx) || isRetry(ctx) {
		kv = append(kv, RetriedAboveKey, "1")
	}
	if len(kv) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// retriedAbove reports whether the request being served carries
// RetriedAboveKey.
func retriedAbove(ctx context.Context) bool {
	return len(metadata.ValueFromIncomingContext(ctx, RetriedAboveKey)) > 0
}
