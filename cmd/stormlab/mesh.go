package stormlab

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/mesh"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// MeshDepth is the hops of the mesh lab's chain: user client → gateway →
// service → leaf. Hop 1 is the user's client, hop MeshDepth the service's
// client of the leaf.
const MeshDepth = 3

// The mesh strategies' names.
const (
	MeshNoRetries  = "no retries"
	MeshGGM        = "go-grpc-middleware at every layer"
	MeshGRPCRetry  = "gRPC retry at every layer"
	MeshHerdguard  = "herdguard at every layer"
	MeshServerHalf = "herdguard + server half"
	MeshLastHop    = "herdguard at the last hop only"
)

// GGMPeer is the External name of go-grpc-middleware's retry: the ggm-tier
// binary (module cmd, cmd/ggm-tier) has it; herdguard's library module does
// not depend on it.
const GGMPeer = "go-grpc-middleware"

// MeshStrategy is what each hop's client of the mesh lab's chain is.
type MeshStrategy struct {
	Name string
	// Hop returns the strategy of hop h's client (1 to MeshDepth), at full
	// scale. Unused when External is set.
	Hop func(h int) Strategy
	// ServerHalf installs herdguard's server half: mesh.ServerOptions on
	// the tiers' servers, and mesh.DialOptions around every hop's
	// herdguard client, the user's included.
	ServerHalf bool
	// External, if set, names the client every hop has, one herdguard's
	// module does not depend on (GGMPeer): the tiers run in the binary that
	// has it, and the user's hop runs in one more such tier in front of
	// the gateway, which the lab calls once per call.
	External string
}

// herdguardDefaults is policy.Default with the default breaker and
// overload control: interceptor.New's defaults.
func herdguardDefaults() Strategy {
	return Strategy{Name: HerdguardDefault, Policy: policy.Default(), Breaker: &breaker.Settings{}}
}

// MeshStrategies are the mesh lab's strategies, in the order its tables
// list them: no retries anywhere; go-grpc-middleware's retry, gRPC's
// built-in retry and herdguard's defaults at every hop; herdguard's
// defaults with the server half; and herdguard's defaults at the last hop
// only, the single retrying layer the others are held to. Every retrying
// client makes policy.Default's 3 attempts at most, on Unavailable, waits
// from 100 ms.
func MeshStrategies() []MeshStrategy {
	every := func(st Strategy) func(int) Strategy { return func(int) Strategy { return st } }
	return []MeshStrategy{
		{Name: MeshNoRetries, Hop: every(NoRetriesStrategy())},
		{Name: MeshGGM, External: GGMPeer},
		{Name: MeshGRPCRetry, Hop: every(GRPCRetryStrategy(false))},
		{Name: MeshHerdguard, Hop: every(herdguardDefaults())},
		{Name: MeshServerHalf, Hop: every(herdguardDefaults()), ServerHalf: true},
		{Name: MeshLastHop, Hop: func(h int) Strategy {
			if h == MeshDepth {
				return herdguardDefaults()
			}
			return NoRetriesStrategy()
		}},
	}
}

// MeshStrategyNamed returns the mesh strategy of that name.
func MeshStrategyNamed(name string) (MeshStrategy, bool) {
	for _, ms := range MeshStrategies() {
		if strings.EqualFold(ms.Name, strings.TrimSpace(name)) {
			return ms, true
		}
	}
	return MeshStrategy{}, false
}

// MeshStrategyNames lists the mesh strategies' names, quoted, for a
// command's help.
func MeshStrategyNames() string {
	var names []string
	for _, ms := range MeshStrategies() {
		names = append(names, strconv.Quote(ms.Name))
	}
	return strings.Join(names, ", ")
}

// meshPeerScenario is the scenario, scaled, whose attempts and waits the
// peers' clients take (Strategy.Peer, TierPeers): every mesh scenario has
// policy.Default's.
func meshPeerScenario(scale float64) Scenario { return SteadyCut().Scale(scale) }

// hopClient returns the dial options of hop h's client, durations divided
// by scale, and its herdguard breakers (nil for another client); peers are
// the external clients at hand.
func (ms MeshStrategy) hopClient(h int, scale float64, peers TierPeers, tp trace.TracerProvider) ([]grpc.DialOption, *breaker.Group, error) {
	if ms.External != "" {
		peer, ok := peers[ms.External]
		if !ok {
			return nil, nil, fmt.Errorf("mesh strategy %q needs %s's client, which this binary lacks (cmd/ggm-tier has it)", ms.Name, ms.External)
		}
		return peer(meshPeerScenario(scale)), nil, nil
	}
	st := ms.Hop(h).Scale(scale)
	if st.Peer != nil {
		return st.Peer(meshPeerScenario(scale)), nil, nil
	}
	ic, err := st.interceptor(tp)
	if err != nil {
		return nil, nil, err
	}
	if ms.ServerHalf {
		return mesh.DialOptions(ic), ic.Breakers(), nil
	}
	return ic.DialOptions(), ic.Breakers(), nil
}

// serverOptions are the tiers' server options.
func (ms MeshStrategy) serverOptions() []grpc.ServerOption {
	if ms.ServerHalf {
		return mesh.ServerOptions()
	}
	return nil
}

// MeshScenarios are the leaves the mesh lab runs the chain against: a
// healthy one (MeshHealthy), the sticky brownouts of SteadyCut and
// SteadyOutage, and a leaf that fails 67 % of attempts on its own
// (Partial(0.67)); the user's load is each scenario's, fired at the
// gateway.
func MeshScenarios() []Scenario {
	return []Scenario{MeshHealthy(), SteadyCut(), SteadyOutage(), Partial(0.67)}
}

// meshNamed are the names MeshScenariosNamed knows.
var meshNamed = []struct {
	name string
	scs  func() []Scenario
}{
	{"healthy", func() []Scenario { return []Scenario{MeshHealthy()} }},
	{"steady-cut", func() []Scenario { return []Scenario{SteadyCut()} }},
	{"steady-outage", func() []Scenario { return []Scenario{SteadyOutage()} }},
	{"partial-0.67", func() []Scenario { return []Scenario{Partial(0.67)} }},
	{"brownouts", func() []Scenario { return []Scenario{SteadyCut(), SteadyOutage()} }},
	{"all", MeshScenarios},
	{"trace", func() []Scenario { return []Scenario{MeshTrace()} }},
}

// MeshScenarioNames lists the names MeshScenariosNamed knows, quoted.
func MeshScenarioNames() string {
	var names []string
	for _, n := range meshNamed {
		names = append(names, strconv.Quote(n.name))
	}
	return strings.Join(names, ", ")
}

// MeshScenariosNamed returns the mesh scenarios a short name stands for
// (one of MeshScenarioNames), and whether it is known.
func MeshScenariosNamed(name string) ([]Scenario, bool) {
	for _, n := range meshNamed {
		if n.name == strings.TrimSpace(name) {
			return n.scs(), true
		}
	}
	return nil, false
}

// MeshResult is one run of a mesh strategy: what the user's client
// counted, and the leaf's counts (Result.Stats), which make the attempts
// per user call; what the leaf saw of its attempts' deadlines; and how
// many of its attempts were made for retries above the leaf's caller.
type MeshResult struct {
	Result
	Deadlines DeadlineCounts
	// RetriedAbove is the leaf's attempts made for a retry or hedge of a
	// layer above the leaf's caller (LeafCounts.RetriedAbove).
	RetriedAbove int64
}

// RetriedAbovePerCall is the leaf's attempts made for retries above the
// leaf's caller, per user call; 0 without calls.
func (r MeshResult) RetriedAbovePerCall() float64 {
	if r.Calls == 0 {
		return 0
	}
	return float64(r.RetriedAbove) / float64(r.Calls)
}

// MeshLab runs the chain of the mesh lab: user client → gateway → service
// → leaf, every tier a server of its own on 127.0.0.1, started afresh for
// each run (no breaker or controller state carries over) and stopped after
// it.
type MeshLab struct {
	// ServerBin is the demo server binary the leaf and the tiers run in,
	// each its own process; "" runs them all in this process instead, each
	// its own gRPC server (tests).
	ServerBin string
	// TierBins are the binaries that run the tiers of the strategies with
	// an External client, by its name (GGMPeer: ggm-tier).
	TierBins map[string]string
	// Peers are the External clients of tiers run in this process.
	Peers TierPeers
	// Stderr receives the processes' output; nil discards it.
	Stderr io.Writer
	// OnProgress, if set, is called when a run starts and ends.
	OnProgress func(scenario, strategy string, done bool)
	// Tracing, if set, traces the chain: the user's client (the tracer
	// provider of service "user"), and the leaf and tiers run in this
	// process (LeafService, TierService(h)), with herdguard's spans and
	// otelgrpc's client and server handlers, the trace context carried
	// down every hop (W3C Trace Context).
	Tracing func(service string) trace.TracerProvider
	// OTLP, if set, is the OTLP gRPC collector (host:port on loopback) the
	// leaf and tier processes export their spans to, each as its service.
	OTLP string
}

// UserService is the service name MeshLab.Tracing is asked for the
// user's client by.
const UserService = "user"

func (l *MeshLab) tracer(service string) trace.TracerProvider {
	if l.Tracing == nil {
		return nil
	}
	return l.Tracing(service)
}

// Run starts a fresh chain for ms, fires the scenario's load (sc at full
// scale, durations divided by scale) at its gateway, resets the leaf to
// the scenario's faults and reads its counts, then stops the chain.
func (l *MeshLab) Run(ctx context.Context, sc Scenario, ms MeshStrategy, scale float64) (res MeshResult, err error) {
	ch, err := l.start(ctx, ms, scale)
	if err != nil {
		return res, fmt.Errorf("mesh %q: start the chain: %w", ms.Name, err)
	}
	defer func() { err = errors.Join(err, ch.stop()) }()
	user := ms
	if ms.External != "" {
		// The edge tier in front of the gateway is the user's hop: the lab
		// calls it once per call.
		user = MeshStrategy{Name: ms.Name, Hop: func(int) Strategy { return NoRetriesStrategy() }}
	}
	tp := l.tracer(UserService)
	dial, breakers, err := user.hopClient(1, scale, l.Peers, tp)
	if err != nil {
		return res, err
	}
	r := &Runner{Addr: ch.gateway, ControlAddr: ch.leaf, OnProgress: l.OnProgress, TracerProvider: tp,
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(StampUserDeadline())}}
	if tp != nil {
		r.DialOptions = append(r.DialOptions, ClientTracing(tp))
	}
	res.Result, err = r.RunClient(ctx, sc.Scale(scale), ms.Name, dial, breakers)
	if err != nil {
		return res, err
	}
	lc, err := readLeafCountsAt(ctx, ch.leaf)
	res.Deadlines, res.RetriedAbove = lc.Deadlines, lc.RetriedAbove
	return res, err
}

func readLeafCountsAt(ctx context.Context, addr string) (LeafCounts, error) {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return LeafCounts{}, err
	}
	defer cc.Close()
	return ReadLeafCounts(ctx, demov1.NewGatewayServiceClient(cc))
}

// chain is a started chain: the address the user's client calls, the
// leaf's, and how to stop it all.
type chain struct {
	gateway, leaf string
	stops         []func() error // in the order started
}

// stop stops the chain from the top down.
func (c *chain) stop() error {
	var errs []error
	for i := len(c.stops) - 1; i >= 0; i-- {
		errs = append(errs, c.stops[i]())
	}
	c.stops = nil
	return errors.Join(errs...)
}

// start starts the leaf, then the tiers from the bottom up, each told the
// address of the one below: the service (hop MeshDepth's client), the
// gateway and, for an External strategy, the edge tier that is the user's
// hop.
func (l *MeshLab) start(ctx context.Context, ms MeshStrategy, scale float64) (ch *chain, err error) {
	ch = &chain{}
	defer func() {
		if err != nil {
			_ = ch.stop()
		}
	}()
	leaf, stop, err := l.startLeaf(ctx)
	if err != nil {
		return ch, fmt.Errorf("the leaf: %w", err)
	}
	ch.stops, ch.leaf, ch.gateway = append(ch.stops, stop), leaf, leaf
	first := 2
	if ms.External != "" {
		first = 1
	}
	for h := MeshDepth; h >= first; h-- {
		o := TierOptions{Tier: true, Next: ch.gateway, Strategy: ms.Name, Hop: h, Scale: scale, Addr: "127.0.0.1:0"}
		addr, stop, err := l.startTier(ctx, ms, o)
		if err != nil {
			return ch, fmt.Errorf("the tier of hop %d: %w", h, err)
		}
		ch.stops, ch.gateway = append(ch.stops, stop), addr
	}
	return ch, nil
}

func (l *MeshLab) startLeaf(ctx context.Context) (string, func() error, error) {
	if l.ServerBin == "" {
		var opts []grpc.ServerOption
		if tp := l.tracer(LeafService); tp != nil {
			opts = append(opts, ServerTracing(tp))
		}
		_, addr, stop, err := ServeLoopback(Faults{}, opts...)
		if err != nil {
			return "", nil, err
		}
		return addr, func() error { stop(); return nil }, nil
	}
	var args, env []string
	if l.OTLP != "" {
		args, env = []string{"-otlp", l.OTLP}, []string{"OTEL_SERVICE_NAME=" + LeafService}
	}
	return startProcess(ctx, l.ServerBin, args, env, l.Stderr)
}

func (l *MeshLab) startTier(ctx context.Context, ms MeshStrategy, o TierOptions) (string, func() error, error) {
	bin := l.ServerBin
	if ms.External != "" {
		bin = l.TierBins[ms.External]
		if bin == "" && l.ServerBin != "" {
			return "", nil, fmt.Errorf("mesh strategy %q needs the binary with %s's client (ggm-tier)", ms.Name, ms.External)
		}
	}
	if bin == "" {
		return l.serveTierHere(ctx, ms, o)
	}
	args := []string{"-tier", "-next", o.Next, "-mesh-strategy", o.Strategy, "-hop", strconv.Itoa(o.Hop),
		"-scale", strconv.FormatFloat(o.Scale, 'g', -1, 64)}
	if l.OTLP != "" {
		args = append(args, "-otlp", l.OTLP)
	}
	return startProcess(ctx, bin, args, nil, l.Stderr)
}

// serveTierHere serves a tier in this process, as RunTier would.
func (l *MeshLab) serveTierHere(ctx context.Context, ms MeshStrategy, o TierOptions) (string, func() error, error) {
	tp := l.tracer(TierService(o.Hop))
	dial, _, err := ms.hopClient(o.Hop, o.Scale, l.Peers, tp)
	if err != nil {
		return "", nil, err
	}
	var opts []grpc.ServerOption
	if tp != nil {
		dial = append(dial, ClientTracing(tp))
		opts = append(opts, ServerTracing(tp))
	}
	t, err := NewTier(o.Next, dial)
	if err != nil {
		return "", nil, err
	}
	addr, stop, err := serveLoopback(t.Register(append(opts, ms.serverOptions()...)...))
	if err != nil {
		t.Close()
		return "", nil, err
	}
	t.Connect(ctx)
	return addr, func() error { stop(); return t.Close() }, nil
}

// startProcess starts bin with args and -addr 127.0.0.1:0 -addr-file, and
// env added to this process's environment, waits
// until it has written its address (at most 10 s), and returns it and how
// to stop the process: SIGTERM to its process id, then, if it has not
// exited within 5 s, SIGKILL.
func startProcess(ctx context.Context, bin string, args, env []string, stderr io.Writer) (string, func() error, error) {
	dir, err := os.MkdirTemp("", "stormlab-mesh-")
	if err != nil {
		return "", nil, err
	}
	defer os.RemoveAll(dir)
	addrFile := filepath.Join(dir, "addr")
	if stderr == nil {
		stderr = io.Discard
	}
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0", "-addr-file", addrFile}, args...)...)
	cmd.Stdout, cmd.Stderr = io.Discard, stderr
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() error {
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return err
		}
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		select {
		case <-exited:
			return nil
		case <-t.C:
			_ = cmd.Process.Kill()
			<-exited
			return fmt.Errorf("%s did not stop within 5 s of SIGTERM: killed", filepath.Base(bin))
		}
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	limit := time.NewTimer(10 * time.Second)
	defer limit.Stop()
	for {
		if b, err := os.ReadFile(addrFile); err == nil && CheckLoopback(string(b)) == nil {
			return string(b), stop, nil
		}
		select {
		case err := <-exited:
			return "", nil, fmt.Errorf("%s %s exited before listening: %v", filepath.Base(bin), strings.Join(args, " "), err)
		case <-limit.C:
			_ = stop()
			return "", nil, fmt.Errorf("%s did not start within 10 s", filepath.Base(bin))
		case <-ctx.Done():
			_ = stop()
			return "", nil, ctx.Err()
		case <-tick.C:
		}
	}
}
