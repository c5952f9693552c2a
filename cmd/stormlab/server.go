// Package stormlab is the retry-storm experiment behind the demo commands:
// a payment gateway that injects faults, among them a sticky or a gentle
// overload and triggers that end, and counts every attempt by arrival time
// (the server), and a driver that fires a herd of calls, or a steady load
// open loop, through herdguard configured as each strategy (or any other
// client) and reports what the server and the client counted (the client).
// It drives herdguard through its public API; it reads the span attributes
// and wire keys herdguard writes by their names in internal/names and
// internal/wire.
package stormlab

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// DefaultWindow is the width of the counting windows at full scale.
const DefaultWindow = 100 * time.Millisecond

// IdempotencyKeyMetadata is the metadata key the gateway reads a charge's
// idempotency key from, when the request carries none.
const IdempotencyKeyMetadata = "idempotency-key"

// The overload models a capacity limit can follow; see Faults.Model.
const (
	// ModelSticky fails every attempt once a capacity window takes more
	// than its capacity, until arrivals have stayed within capacity for
	// RecoverAfter: retries that keep coming keep it down.
	ModelSticky = "sticky"
	// ModelGentle serves attempts in arrival order at Capacity per
	// CapacityWindow through a queue: an attempt waits for its turn, or
	// fails at once if its turn is more than QueueLimit away.
	ModelGentle = "gentle"
)

// Faults are the server's fault models; see demov1.Faults. The zero value
// injects no faults and counts in DefaultWindow windows. Their clock
// (windows, Outage, the trigger) starts at the first counted arrival after
// a reset, so a herd's first attempts open its first window.
type Faults struct {
	FailRate       float64       // each attempt fails with this probability
	Outage         time.Duration // every attempt fails this long after the clock starts
	Capacity       int           // attempts accepted per CapacityWindow; 0 = unlimited
	CapacityWindow time.Duration // 0 = the counting window
	RecoverAfter   time.Duration // sticky model: calm needed to leave overload; 0 = one capacity window
	LostReplyRate  float64       // a charge is applied, then the reply is "lost"
	Seed           int64
	Window         time.Duration // counting window; 0 = DefaultWindow
	// Latency delays every attempt that passed the other faults, plus a
	// uniform part of LatencySpread; with probability SlowRate it takes
	// SlowLatency instead (a slow replica, a pause).
	Latency, LatencySpread time.Duration
	SlowRate               float64
	SlowLatency            time.Duration
	// Model is how the server behaves over capacity: ModelSticky (the
	// default; "" means it) or ModelGentle.
	Model string
	// QueueLimit is the longest wait in the gentle model's queue; 0 means
	// ten capacity windows (1 s at full scale).
	QueueLimit time.Duration
	// TriggerAt and TriggerFor bound a trigger, from TriggerAt after the
	// clock starts for TriggerFor (0: no trigger). During it the capacity
	// per window is TriggerCapacity instead of Capacity or, with
	// TriggerOutage, every attempt fails; the sticky model takes an outage
	// as capacity 0, so it still needs RecoverAfter of calm after it ends.
	TriggerAt, TriggerFor time.Duration
	TriggerCapacity       int
	TriggerOutage         bool
	// TriggerKill makes the trigger the server's process gone: served by
	// a [Host], it stops listening and drops every connection when the
	// trigger starts, and listens again on the same address when it ends.
	TriggerKill bool
}

func (f Faults) withDefaults() Faults {
	if f.Window <= 0 {
		f.Window = DefaultWindow
	}
	if f.CapacityWindow <= 0 {
		f.CapacityWindow = f.Window
	}
	if f.RecoverAfter <= 0 {
		f.RecoverAfter = f.CapacityWindow
	}
	if f.Model == "" {
		f.Model = ModelSticky
	}
	if f.QueueLimit <= 0 {
		f.QueueLimit = 10 * f.CapacityWindow
	}
	return f
}

// limited reports whether capacity is limited at any time.
func (f Faults) limited() bool { return f.Capacity > 0 || f.TriggerFor > 0 }

// capacityAt returns the attempts accepted per capacity window at since
// after the clock started, and whether they are limited at all: during the
// trigger TriggerCapacity, or 0 for an outage; otherwise Capacity.
func (f Faults) capacityAt(since time.Duration) (int, bool) {
	if f.TriggerFor > 0 && since >= f.TriggerAt && since < f.TriggerAt+f.TriggerFor {
		if f.TriggerOutage {
			return 0, true
		}
		return f.TriggerCapacity, true
	}
	return f.Capacity, f.Capacity > 0
}

// Validate reports the first unusable field, naming it and its value.
func (f Faults) Validate() error {
	bad := func(field string, v any, why string) error {
		return fmt.Errorf("stormlab: Faults.%s = %v: %s", field, v, why)
	}
	for _, r := range []struct {
		name string
		v    float64
	}{{"FailRate", f.FailRate}, {"LostReplyRate", f.LostReplyRate}, {"SlowRate", f.SlowRate}} {
		if !(r.v >= 0 && r.v <= 1) {
			return bad(r.name, r.v, "must be in [0, 1]")
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"Outage", f.Outage}, {"CapacityWindow", f.CapacityWindow}, {"RecoverAfter", f.RecoverAfter}, {"Window", f.Window},
		{"Latency", f.Latency}, {"LatencySpread", f.LatencySpread}, {"SlowLatency", f.SlowLatency},
		{"QueueLimit", f.QueueLimit}, {"TriggerAt", f.TriggerAt}, {"TriggerFor", f.TriggerFor},
	} {
		if d.v < 0 {
			return bad(d.name, d.v, "must not be negative")
		}
	}
	switch {
	case f.Capacity < 0:
		return bad("Capacity", f.Capacity, "must not be negative (0 is unlimited)")
	case f.TriggerCapacity < 0:
		return bad("TriggerCapacity", f.TriggerCapacity, "must not be negative")
	case f.Model != "" && f.Model != ModelSticky && f.Model != ModelGentle:
		return bad("Model", fmt.Sprintf("%q", f.Model), fmt.Sprintf("want %q or %q", ModelSticky, ModelGentle))
	case f.TriggerFor > 0 && !f.TriggerOutage && !f.TriggerKill && f.TriggerCapacity == 0:
		return bad("TriggerCapacity", 0, fmt.Sprintf("a trigger of %v needs a capacity above 0, or TriggerOutage, or TriggerKill", f.TriggerFor))
	case f.TriggerFor == 0 && (f.TriggerOutage || f.TriggerKill || f.TriggerCapacity > 0 || f.TriggerAt > 0):
		return bad("TriggerFor", 0, "a trigger (TriggerAt, TriggerCapacity, TriggerOutage, TriggerKill) needs a length")
	}
	return nil
}

// Proto converts f for a ResetStats request.
func (f Faults) Proto() *demov1.Faults {
	return &demov1.Faults{
		FailRate: f.FailRate, OutageNs: int64(f.Outage),
		Capacity: int64(f.Capacity), CapacityWindowNs: int64(f.CapacityWindow),
		RecoverAfterNs: int64(f.RecoverAfter), LostReplyRate: f.LostReplyRate,
		Seed: f.Seed, WindowNs: int64(f.Window),
		LatencyNs: int64(f.Latency), LatencySpreadNs: int64(f.LatencySpread),
		SlowRate: f.SlowRate, SlowLatencyNs: int64(f.SlowLatency),
		Model: f.Model, QueueLimitNs: int64(f.QueueLimit),
		TriggerAtNs: int64(f.TriggerAt), TriggerForNs: int64(f.TriggerFor),
		TriggerCapacity: int64(f.TriggerCapacity), TriggerOutage: f.TriggerOutage, TriggerKill: f.TriggerKill,
	}
}

// FaultsFromProto is the inverse of Faults.Proto.
func FaultsFromProto(p *demov1.Faults) Faults {
	ns := func(v int64) time.Duration { return time.Duration(v) }
	return Faults{
		FailRate: p.GetFailRate(), Outage: ns(p.GetOutageNs()), Capacity: int(p.GetCapacity()),
		CapacityWindow: ns(p.GetCapacityWindowNs()), RecoverAfter: ns(p.GetRecoverAfterNs()),
		LostReplyRate: p.GetLostReplyRate(), Seed: p.GetSeed(), Window: ns(p.GetWindowNs()),
		Latency: ns(p.GetLatencyNs()), LatencySpread: ns(p.GetLatencySpreadNs()),
		SlowRate: p.GetSlowRate(), SlowLatency: ns(p.GetSlowLatencyNs()),
		Model: p.GetModel(), QueueLimit: ns(p.GetQueueLimitNs()),
		TriggerAt: ns(p.GetTriggerAtNs()), TriggerFor: ns(p.GetTriggerForNs()),
		TriggerCapacity: int(p.GetTriggerCapacity()), TriggerOutage: p.GetTriggerOutage(), TriggerKill: p.GetTriggerKill(),
	}
}

// Server is the gateway. It is safe for concurrent use.
type Server struct {
	demov1.UnimplementedGatewayServiceServer
	now func() time.Time

	mu       sync.Mutex
	faults   Faults
	rnd      *rand.Rand
	start    time.Time // the clock's start: the first counted arrival; zero before it
	windows  []*demov1.Window
	tenths   []tenth                 // the same arrivals in tenths of a window
	total    demov1.GetStatsResponse // counters only
	lastOK   time.Duration
	charges  map[string]string // idempotency key -> charge id
	order    []string          // charge ids in order
	amounts  map[string]int64
	overload overload
	queueEnd time.Time // the gentle model's last service slot given out
	deadline DeadlineCounts
	// retriedAbove counts the attempts that carried RetriedAboveKey.
	retriedAbove int64
	// host serves the gateway, when a Host does: TriggerKill stops and
	// restarts it, by the timers in kills.
	host  *Host
	kills []*time.Timer
}

// tenth counts the arrivals of a tenth of a window.
type tenth struct{ attempts, retries int64 }

// overload is the load-dependent fault model's state.
type overload struct {
	windowStart time.Time // start of the current capacity window; zero before the clock starts
	inWindow    int       // arrivals in it
	overloaded  bool
	since       time.Time     // when the current overload began
	calmSince   time.Time     // start of the current run of windows within capacity
	recoveredAt time.Duration // since the clock started; -1 = not recovered
	spent       time.Duration // total time overloaded
}

// NewServer returns a gateway with the given faults.
func NewServer(f Faults) (*Server, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	s := &Server{now: time.Now}
	s.reset(f)
	return s, nil
}

// reset clears the counts and stops the fault clocks: the first counted
// arrival starts them again.
func (s *Server) reset(f Faults) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = f.withDefaults()
	s.rnd = rand.New(rand.NewPCG(uint64(f.Seed), uint64(f.Seed)^0x9e3779b97f4a7c15))
	s.start = time.Time{}
	s.windows, s.tenths = nil, nil
	s.total = demov1.GetStatsResponse{}
	s.lastOK = 0
	s.charges, s.order, s.amounts = map[string]string{}, nil, map[string]int64{}
	s.overload = overload{recoveredAt: -1}
	s.queueEnd = time.Time{}
	s.deadline = DeadlineCounts{}
	s.retriedAbove = 0
	for _, t := range s.kills {
		t.Stop()
	}
	s.kills = nil
	if s.host != nil {
		go s.host.revive() // a reset during a kill: back at once
	}
}

// Register adds the gateway and its fault-injecting, counting interceptors
// to a new gRPC server made with opts (for instance [ServerTracing]).
func (s *Server) Register(opts ...grpc.ServerOption) *grpc.Server {
	opts = append(opts[:len(opts):len(opts)], grpc.ChainUnaryInterceptor(s.unaryFaults), grpc.ChainStreamInterceptor(s.streamFaults))
	g := grpc.NewServer(opts...)
	demov1.RegisterGatewayServiceServer(g, s)
	return g
}

// controlMethods are neither counted nor failed.
func controlMethod(m string) bool {
	return m == demov1.GatewayService_GetStats_FullMethodName || m == demov1.GatewayService_ResetStats_FullMethodName
}

func (s *Server) unaryFaults(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if controlMethod(info.FullMethod) {
		return h(ctx, req)
	}
	w, queued, err := s.arrive(ctx)
	if err != nil {
		return nil, err
	}
	if err := sleep(ctx, queued); err != nil {
		s.finish(w, err) // the caller gave up while the attempt waited its turn
		return nil, err
	}
	if err := s.delay(ctx); err != nil {
		s.finish(w, err) // the caller gave up while the attempt was slow
		return nil, err
	}
	resp, err := h(ctx, req)
	if err == nil && info.FullMethod == demov1.GatewayService_Charge_FullMethodName && s.lostReply() {
		err = status.Error(codes.Unavailable, "stormlab: charge applied, reply lost")
	}
	s.finish(w, err)
	return resp, err
}

func (s *Server) streamFaults(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	w, queued, err := s.arrive(ss.Context())
	if err != nil {
		return err
	}
	if err := sleep(ss.Context(), queued); err != nil {
		s.finish(w, err)
		return err
	}
	err = h(srv, ss)
	s.finish(w, err)
	return err
}

// arrive counts an attempt in its window and decides whether the faults
// fail it; a failure is counted here. The first arrival after a reset
// starts the clock. Under the gentle model, queued is how long the attempt
// must wait for its turn before it is served.
func (s *Server) arrive(ctx context.Context) (w *demov1.Window, queued time.Duration, err error) {
	retry := isRetry(ctx)
	dl, hasDeadline := ctx.Deadline()
	user, stamped := UserDeadline(ctx)
	above := retriedAbove(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deadline.add(dl, hasDeadline, user, stamped)
	if above {
		s.retriedAbove++
	}
	now := s.now()
	if s.start.IsZero() {
		s.start, s.overload.windowStart = now, now
		if f := s.faults; f.TriggerKill && s.host != nil {
			s.kills = []*time.Timer{time.AfterFunc(f.TriggerAt, s.host.kill), time.AfterFunc(f.TriggerAt+f.TriggerFor, s.host.revive)}
		}
	}
	since := now.Sub(s.start)
	w = s.windowLocked(since)
	s.tenthLocked(since, retry)
	s.total.Attempts++
	if retry {
		w.Retries++
		s.total.Retries++
	} else {
		w.FirstAttempts++
		s.total.FirstAttempts++
	}
	switch {
	case s.faults.Model == ModelSticky && s.overloadedLocked(now):
		err = status.Error(codes.Unavailable, "stormlab: overloaded")
	case since < s.faults.Outage:
		err = status.Error(codes.Unavailable, "stormlab: outage")
	case s.faults.FailRate > 0 && s.rnd.Float64() < s.faults.FailRate:
		err = status.Error(codes.Unavailable, "stormlab: injected failure")
	case s.faults.Model == ModelGentle:
		queued, err = s.queueLocked(now, since)
	}
	if err != nil {
		w.Failed++
		s.total.Failed++
	}
	return w, queued, err
}

// queueLocked gives an attempt its service slot under the gentle model:
// the server serves Capacity attempts per CapacityWindow in arrival order,
// so the next slot is one service time (CapacityWindow/Capacity) after the
// later of now and the last slot given out. An attempt whose slot is more
// than QueueLimit away fails at once and takes no slot; during a trigger's
// outage every attempt fails.
func (s *Server) queueLocked(now time.Time, since time.Duration) (time.Duration, error) {
	f := s.faults
	c, limited := f.capacityAt(since)
	switch {
	case !limited:
		return 0, nil
	case c == 0:
		return 0, status.Error(codes.Unavailable, "stormlab: outage")
	}
	slot := now
	if s.queueEnd.After(slot) {
		slot = s.queueEnd
	}
	slot = slot.Add(f.CapacityWindow / time.Duration(c))
	wait := slot.Sub(now)
	if wait > f.QueueLimit {
		return 0, status.Error(codes.Unavailable, "stormlab: overloaded")
	}
	s.queueEnd = slot
	return wait, nil
}

// delay makes an attempt take the latency the faults give it, or less if
// its caller gives up first.
func (s *Server) delay(ctx context.Context) error {
	s.mu.Lock()
	f := s.faults
	var d time.Duration
	switch {
	case f.SlowRate > 0 && s.rnd.Float64() < f.SlowRate:
		d = f.SlowLatency
	case f.Latency > 0 || f.LatencySpread > 0:
		d = f.Latency + time.Duration(s.rnd.Float64()*float64(f.LatencySpread))
	}
	s.mu.Unlock()
	if d <= 0 {
		return nil
	}
	return sleep(ctx, d)
}

// sleep waits d, or less if ctx ends first, which it reports as the
// status of the context's error.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// isRetry tells a retry from a first attempt by the metadata each client
// sends: herdguard's attempt number (2, 3, ...), gRPC's own retry's count of
// previous attempts (1, 2, ...), or go-grpc-middleware's retry number.
func isRetry(ctx context.Context) bool {
	md, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return false
	}
	for key, first := range map[string]int{wire.AttemptKey: 2, "grpc-previous-rpc-attempts": 1, "x-retry-attempt": 1} {
		if v := md.Get(key); len(v) > 0 {
			if n, err := strconv.Atoi(v[0]); err == nil && n >= first {
				return true
			}
		}
	}
	return false
}

// finish counts how an attempt that passed the faults ended.
func (s *Server) finish(w *demov1.Window, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		w.Failed++
		s.total.Failed++
		return
	}
	w.Succeeded++
	s.total.Succeeded++
	s.lastOK = s.now().Sub(s.start)
}

func (s *Server) tenthLocked(since time.Duration, retry bool) {
	i := int(since * 10 / s.faults.Window)
	for len(s.tenths) <= i {
		s.tenths = append(s.tenths, tenth{})
	}
	s.tenths[i].attempts++
	if retry {
		s.tenths[i].retries++
	}
}

// slidingPeaksLocked returns the most attempts and retries in any ten
// consecutive tenths of a window.
func (s *Server) slidingPeaksLocked() (attempts, retries int64) {
	var a, r int64
	for i, t := range s.tenths {
		a, r = a+t.attempts, r+t.retries
		if i >= 10 {
			a, r = a-s.tenths[i-10].attempts, r-s.tenths[i-10].retries
		}
		attempts, retries = max(attempts, a), max(retries, r)
	}
	return attempts, retries
}

func (s *Server) windowLocked(since time.Duration) *demov1.Window {
	i := int(since / s.faults.Window)
	for len(s.windows) <= i {
		s.windows = append(s.windows, &demov1.Window{})
	}
	return s.windows[i]
}

// advanceLocked moves the sticky model's capacity window up to now: each
// window that closed within its capacity (the one in force at its start)
// extends the calm, and enough calm ends an overload.
func (s *Server) advanceLocked(now time.Time) {
	f, o := s.faults, &s.overload
	if o.windowStart.IsZero() {
		return // the clock has not started
	}
	for now.Sub(o.windowStart) >= f.CapacityWindow {
		if c, limited := f.capacityAt(o.windowStart.Sub(s.start)); limited && o.inWindow > c {
			o.calmSince = time.Time{}
		} else if o.calmSince.IsZero() {
			o.calmSince = o.windowStart
		}
		o.windowStart = o.windowStart.Add(f.CapacityWindow)
		o.inWindow = 0
		if o.overloaded && !o.calmSince.IsZero() && o.windowStart.Sub(o.calmSince) >= f.RecoverAfter {
			o.overloaded = false
			o.spent += o.windowStart.Sub(o.since)
			o.recoveredAt = o.windowStart.Sub(s.start)
		}
	}
}

// overloadedLocked counts an arrival against capacity and reports whether
// the sticky model is overloaded for it: once a window takes more than its
// capacity, every attempt fails until arrivals have stayed within capacity
// for RecoverAfter. Retries that keep coming keep it down.
func (s *Server) overloadedLocked(now time.Time) bool {
	f, o := s.faults, &s.overload
	if !f.limited() {
		return false
	}
	s.advanceLocked(now)
	o.inWindow++
	if c, limited := f.capacityAt(o.windowStart.Sub(s.start)); limited && o.inWindow > c && !o.overloaded {
		o.overloaded, o.since, o.recoveredAt = true, now, -1
		o.calmSince = time.Time{}
	}
	return o.overloaded
}

func (s *Server) lostReply() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults.LostReplyRate > 0 && s.rnd.Float64() < s.faults.LostReplyRate
}

// Charge applies a charge once per idempotency key; a repeated key is
// refused as a duplicate and answered with the first charge.
func (s *Server) Charge(ctx context.Context, req *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	if req.GetAmountCents() <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "amount_cents %d: must be positive", req.GetAmountCents())
	}
	key := req.GetIdempotencyKey()
	if key == "" {
		if md, ok := metadata.FromIncomingContext(ctx); ok {
			if v := md.Get(IdempotencyKeyMetadata); len(v) > 0 {
				key = v[0]
			}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if id, ok := s.charges[key]; ok && key != "" {
		s.total.DuplicatesRefused++
		return &demov1.ChargeResponse{ChargeId: id, Duplicate: true}, nil
	}
	id := fmt.Sprintf("ch_%06d", len(s.order)+1)
	if key != "" {
		s.charges[key] = id
	}
	s.order = append(s.order, id)
	s.amounts[id] = req.GetAmountCents()
	s.total.ChargesApplied++
	return &demov1.ChargeResponse{ChargeId: id}, nil
}

// ListCharges streams the charges taken so far, up to limit (0: all).
func (s *Server) ListCharges(req *demov1.ListChargesRequest, stream grpc.ServerStreamingServer[demov1.ListChargesResponse]) error {
	s.mu.Lock()
	ids := append([]string(nil), s.order...)
	amounts := make([]int64, len(ids))
	for i, id := range ids {
		amounts[i] = s.amounts[id]
	}
	s.mu.Unlock()
	if n := int(req.GetLimit()); n > 0 && n < len(ids) {
		ids = ids[:n]
	}
	for i, id := range ids {
		if err := stream.Send(&demov1.ListChargesResponse{ChargeId: id, AmountCents: amounts[i]}); err != nil {
			return err
		}
	}
	return nil
}

// UploadReceipts counts the receipts and bytes it is sent.
func (s *Server) UploadReceipts(stream grpc.ClientStreamingServer[demov1.UploadReceiptsRequest, demov1.UploadReceiptsResponse]) error {
	var resp demov1.UploadReceiptsResponse
	for {
		r, err := stream.Recv()
		if err != nil {
			if err == io.EOF {
				return stream.SendAndClose(&resp)
			}
			return err
		}
		resp.Receipts++
		resp.Bytes += int64(len(r.GetReceipt()))
	}
}

// GetStats returns the counts since the last reset, times since the clock
// started (at the first counted arrival).
//
// Its trailers say how the attempts' deadlines compared with their users'
// (DeadlinesTrailerKey) and how many were made for retries above the
// leaf's caller (RetriedAboveTrailerKey); see ReadLeafCounts.
func (s *Server) GetStats(ctx context.Context, _ *demov1.GetStatsRequest) (*demov1.GetStatsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_ = grpc.SetTrailer(ctx, metadata.Pairs(DeadlinesTrailerKey, s.deadline.String(),
		RetriedAboveTrailerKey, strconv.FormatInt(s.retriedAbove, 10)))
	now := s.now()
	if s.faults.Model == ModelSticky && s.faults.limited() {
		s.advanceLocked(now)
	}
	resp := &demov1.GetStatsResponse{
		WindowMs:          s.faults.Window.Milliseconds(),
		Attempts:          s.total.Attempts,
		FirstAttempts:     s.total.FirstAttempts,
		Retries:           s.total.Retries,
		Succeeded:         s.total.Succeeded,
		Failed:            s.total.Failed,
		DuplicatesRefused: s.total.DuplicatesRefused,
		ChargesApplied:    s.total.ChargesApplied,
		Overloaded:        s.overload.overloaded,
		LastSuccessMs:     s.lastOK.Milliseconds(),
		RecoveredMs:       s.overload.recoveredAt.Milliseconds(),
		OverloadedMs:      s.overload.spent.Milliseconds(),
	}
	if s.overload.overloaded {
		resp.OverloadedMs += now.Sub(s.overload.since).Milliseconds()
	}
	resp.PeakAttemptsSliding, resp.PeakRetriesSliding = s.slidingPeaksLocked()
	if s.overload.recoveredAt < 0 {
		resp.RecoveredMs = -1
	}
	for _, w := range s.windows {
		resp.Windows = append(resp.Windows, &demov1.Window{FirstAttempts: w.FirstAttempts, Retries: w.Retries, Failed: w.Failed, Succeeded: w.Succeeded})
		resp.PeakRetries = max(resp.PeakRetries, w.Retries)
		resp.PeakAttempts = max(resp.PeakAttempts, w.FirstAttempts+w.Retries)
	}
	return resp, nil
}

// ResetStats clears the counts, stops the fault clocks until the next
// counted arrival and, if given, replaces the faults.
func (s *Server) ResetStats(_ context.Context, req *demov1.ResetStatsRequest) (*demov1.ResetStatsResponse, error) {
	f := s.Faults()
	if req.GetFaults() != nil {
		f = FaultsFromProto(req.GetFaults())
		if err := f.Validate(); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	s.reset(f)
	return &demov1.ResetStatsResponse{}, nil
}

// Faults returns the faults in force.
func (s *Server) Faults() Faults {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults
}

// ServeLoopback serves a new gateway with faults f on 127.0.0.1, on a port
// the system picks, with opts, until stop is called; stop returns once the
// server has stopped. Tests, benchmarks and the mesh lab's leaf use it.
func ServeLoopback(f Faults, opts ...grpc.ServerOption) (s *Server, addr string, stop func(), err error) {
	s, err = NewServer(f)
	if err != nil {
		return nil, "", nil, err
	}
	h, err := s.Serve("127.0.0.1:0", opts...)
	if err != nil {
		return nil, "", nil, err
	}
	return s, h.Addr(), h.Stop, nil
}

// serveLoopback serves g on 127.0.0.1, on a port the system picks, until
// stop is called; stop returns once g has stopped.
func serveLoopback(g *grpc.Server) (addr string, stop func(), err error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	return lis.Addr().String(), func() { g.Stop(); <-done }, nil
}

// Host serves a gateway on a TCP address, as its process does: a trigger
// with TriggerKill stops it, as if the process were killed (the listener
// closed, every connection dropped), and it comes back on the same
// address when the trigger ends. Make one with [Server.Serve].
type Host struct {
	s    *Server
	opts []grpc.ServerOption
	addr string

	mu      sync.Mutex
	g       *grpc.Server // nil while killed or stopped
	done    chan struct{}
	stopped bool
}

// Serve serves s on addr (port 0 picks one) with opts, until the Host is
// stopped.
func (s *Server) Serve(addr string, opts ...grpc.ServerOption) (*Host, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	h := &Host{s: s, opts: opts, addr: lis.Addr().String()}
	h.mu.Lock()
	h.serveLocked(lis)
	h.mu.Unlock()
	s.mu.Lock()
	s.host = h
	s.mu.Unlock()
	return h, nil
}

// Addr is the address the Host serves on.
func (h *Host) Addr() string { return h.addr }

func (h *Host) serveLocked(lis net.Listener) {
	g, done := h.s.Register(h.opts...), make(chan struct{})
	h.g, h.done = g, done
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
}

// kill stops serving, dropping every connection.
func (h *Host) kill() {
	h.mu.Lock()
	g, done := h.g, h.done
	h.g = nil
	h.mu.Unlock()
	if g != nil {
		g.Stop()
		<-done
	}
}

// revive serves again on the same address after a kill. The address can
// stay taken for a moment after the old listener closed: it tries for a
// second.
func (h *Host) revive() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.g != nil || h.stopped {
		return
	}
	for range 100 {
		lis, err := net.Listen("tcp", h.addr)
		if err == nil {
			h.serveLocked(lis)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop stops serving for good, and returns once the server has stopped.
func (h *Host) Stop() {
	h.mu.Lock()
	h.stopped = true
	h.mu.Unlock()
	h.kill()
}

// GracefulStop is Stop that lets the calls in progress finish first, for
// at most wait.
func (h *Host) GracefulStop(wait time.Duration) {
	h.mu.Lock()
	h.stopped = true
	g, done := h.g, h.done
	h.g = nil
	h.mu.Unlock()
	if g == nil {
		return
	}
	go g.GracefulStop()
	select {
	case <-done:
	case <-time.After(wait):
		g.Stop()
		<-done
	}
}
