// Package stormlab is the retry-storm experiment behind the demo commands:
// a payment gateway that injects faults and counts every attempt by arrival
// time (the server), and a driver that fires a herd of calls through
// herdguard configured as each strategy and reports what the server counted
// (the client). It uses only herdguard's public API.
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

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// DefaultWindow is the width of the counting windows at full scale.
const DefaultWindow = 100 * time.Millisecond

// IdempotencyKeyMetadata is the metadata key the gateway reads a charge's
// idempotency key from, when the request carries none.
const IdempotencyKeyMetadata = "idempotency-key"

// Faults are the server's fault models; see demov1.Faults. The zero value
// injects no faults and counts in DefaultWindow windows.
type Faults struct {
	FailRate       float64       // each attempt fails with this probability
	Outage         time.Duration // every attempt fails this long after the reset
	Capacity       int           // attempts accepted per CapacityWindow; 0 = unlimited
	CapacityWindow time.Duration // 0 = the counting window
	RecoverAfter   time.Duration // calm needed to leave overload; 0 = one capacity window
	LostReplyRate  float64       // a charge is applied, then the reply is "lost"
	Seed           int64
	Window         time.Duration // counting window; 0 = DefaultWindow
	// Latency delays every attempt that passed the other faults, plus a
	// uniform part of LatencySpread; with probability SlowRate it takes
	// SlowLatency instead (a slow replica, a pause).
	Latency, LatencySpread time.Duration
	SlowRate               float64
	SlowLatency            time.Duration
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
	return f
}

// Validate reports an unusable field by name and value.
func (f Faults) Validate() error {
	switch {
	case f.FailRate < 0 || f.FailRate > 1 || f.FailRate != f.FailRate:
		return fmt.Errorf("fail rate %v: must be in [0, 1]", f.FailRate)
	case f.LostReplyRate < 0 || f.LostReplyRate > 1 || f.LostReplyRate != f.LostReplyRate:
		return fmt.Errorf("lost reply rate %v: must be in [0, 1]", f.LostReplyRate)
	case f.SlowRate < 0 || f.SlowRate > 1 || f.SlowRate != f.SlowRate:
		return fmt.Errorf("slow rate %v: must be in [0, 1]", f.SlowRate)
	case f.Latency < 0 || f.LatencySpread < 0 || f.SlowLatency < 0:
		return fmt.Errorf("latencies must not be negative")
	case f.Outage < 0:
		return fmt.Errorf("outage %v: must not be negative", f.Outage)
	case f.Capacity < 0:
		return fmt.Errorf("capacity %d: must not be negative", f.Capacity)
	case f.CapacityWindow < 0 || f.RecoverAfter < 0 || f.Window < 0:
		return fmt.Errorf("windows must not be negative")
	}
	return nil
}

// Proto converts f for a ResetStats request.
func (f Faults) Proto() *demov1.Faults {
	return &demov1.Faults{
		FailRate: f.FailRate, OutageMs: f.Outage.Milliseconds(),
		Capacity: int64(f.Capacity), CapacityWindowMs: f.CapacityWindow.Milliseconds(),
		RecoverAfterMs: f.RecoverAfter.Milliseconds(), LostReplyRate: f.LostReplyRate,
		Seed: f.Seed, WindowMs: f.Window.Milliseconds(),
		LatencyUs: f.Latency.Microseconds(), LatencySpreadUs: f.LatencySpread.Microseconds(),
		SlowRate: f.SlowRate, SlowLatencyMs: f.SlowLatency.Milliseconds(),
	}
}

// FaultsFromProto is the inverse of Faults.Proto. Durations travel as
// microseconds-precise milliseconds: below 1ms they round to 0.
func FaultsFromProto(p *demov1.Faults) Faults {
	ms := func(v int64) time.Duration { return time.Duration(v) * time.Millisecond }
	us := func(v int64) time.Duration { return time.Duration(v) * time.Microsecond }
	return Faults{
		FailRate: p.GetFailRate(), Outage: ms(p.GetOutageMs()), Capacity: int(p.GetCapacity()),
		CapacityWindow: ms(p.GetCapacityWindowMs()), RecoverAfter: ms(p.GetRecoverAfterMs()),
		LostReplyRate: p.GetLostReplyRate(), Seed: p.GetSeed(), Window: ms(p.GetWindowMs()),
		Latency: us(p.GetLatencyUs()), LatencySpread: us(p.GetLatencySpreadUs()),
		SlowRate: p.GetSlowRate(), SlowLatency: ms(p.GetSlowLatencyMs()),
	}
}

// Server is the gateway. It is safe for concurrent use.
type Server struct {
	demov1.UnimplementedGatewayServiceServer
	now func() time.Time

	mu       sync.Mutex
	faults   Faults
	rnd      *rand.Rand
	start    time.Time
	windows  []*demov1.Window
	tenths   []tenth                 // the same arrivals in tenths of a window
	total    demov1.GetStatsResponse // counters only
	lastOK   time.Duration
	charges  map[string]string // idempotency key -> charge id
	order    []string          // charge ids in order
	amounts  map[string]int64
	overload overload
}

// tenth counts the arrivals of a tenth of a window.
type tenth struct{ attempts, retries int64 }

// overload is the load-dependent fault model's state.
type overload struct {
	windowStart time.Time // start of the current capacity window
	inWindow    int       // arrivals in it
	overloaded  bool
	since       time.Time     // when the current overload began
	calmSince   time.Time     // start of the current run of windows within capacity
	recoveredAt time.Duration // since the reset; -1 = not recovered
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

// reset clears the counts and restarts the fault clocks.
func (s *Server) reset(f Faults) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = f.withDefaults()
	s.rnd = rand.New(rand.NewPCG(uint64(f.Seed), uint64(f.Seed)^0x9e3779b97f4a7c15))
	s.start = s.now()
	s.windows, s.tenths = nil, nil
	s.total = demov1.GetStatsResponse{}
	s.lastOK = 0
	s.charges, s.order, s.amounts = map[string]string{}, nil, map[string]int64{}
	s.overload = overload{windowStart: s.start, recoveredAt: -1}
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
	w, err := s.arrive(ctx)
	if err != nil {
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
	w, err := s.arrive(ss.Context())
	if err != nil {
		return err
	}
	err = h(srv, ss)
	s.finish(w, err)
	return err
}

// arrive counts an attempt in its window and decides whether the faults
// fail it; a failure is counted here.
func (s *Server) arrive(ctx context.Context) (*demov1.Window, error) {
	retry := isRetry(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	since := now.Sub(s.start)
	w := s.windowLocked(since)
	s.tenthLocked(since, retry)
	s.total.Attempts++
	if retry {
		w.Retries++
		s.total.Retries++
	} else {
		w.FirstAttempts++
		s.total.FirstAttempts++
	}
	var err error
	switch {
	case s.overloadedLocked(now):
		err = status.Error(codes.Unavailable, "stormlab: overloaded")
	case since < s.faults.Outage:
		err = status.Error(codes.Unavailable, "stormlab: outage")
	case s.faults.FailRate > 0 && s.rnd.Float64() < s.faults.FailRate:
		err = status.Error(codes.Unavailable, "stormlab: injected failure")
	}
	if err != nil {
		w.Failed++
		s.total.Failed++
	}
	return w, err
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
	for key, first := range map[string]int{interceptor.AttemptMetadataKey: 2, "grpc-previous-rpc-attempts": 1, "x-retry-attempt": 1} {
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

// advanceLocked moves the overload model's capacity window up to now: each
// window that closed within capacity extends the calm, and enough calm ends
// an overload.
func (s *Server) advanceLocked(now time.Time) {
	f, o := s.faults, &s.overload
	for now.Sub(o.windowStart) >= f.CapacityWindow {
		if o.inWindow > f.Capacity {
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
// the server is overloaded for it: once a window takes more than capacity,
// every attempt fails until arrivals have stayed within capacity for
// RecoverAfter. Retries that keep coming keep it down.
func (s *Server) overloadedLocked(now time.Time) bool {
	f, o := s.faults, &s.overload
	if f.Capacity <= 0 {
		return false
	}
	s.advanceLocked(now)
	o.inWindow++
	if o.inWindow > f.Capacity && !o.overloaded {
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

// GetStats returns the counts since the last reset.
func (s *Server) GetStats(context.Context, *demov1.GetStatsRequest) (*demov1.GetStatsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if s.faults.Capacity > 0 {
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
		resp.Windows = append(resp.Windows, &demov1.Window{FirstAttempts: w.FirstAttempts, Retries: w.Retries, Failed: w.Failed})
		resp.PeakRetries = max(resp.PeakRetries, w.Retries)
		resp.PeakAttempts = max(resp.PeakAttempts, w.FirstAttempts+w.Retries)
	}
	return resp, nil
}

// ResetStats clears the counts, restarts the fault clocks and, if given,
// replaces the faults.
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
// the system picks, until stop is called; stop returns once the server has
// stopped. Tests and benchmarks use it.
func ServeLoopback(f Faults) (s *Server, addr string, stop func(), err error) {
	s, err = NewServer(f)
	if err != nil {
		return nil, "", nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", nil, err
	}
	g := s.Register()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	return s, lis.Addr().String(), func() { g.Stop(); <-done }, nil
}
