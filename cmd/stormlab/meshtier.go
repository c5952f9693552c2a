package stormlab

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/trace"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// Tier is one tier of a mesh: a gateway whose Charge forwards the request
// to the next tier, with the request's own context (its deadline goes
// down with it), the user's deadline stamp (UserDeadlineKey) and, for a
// request that is a retry above or carries the mark, RetriedAboveKey, through
// a client the tier's mesh strategy configures, and answers with what
// came back, the error as it is (its status code kept). It serves nothing
// else: resets and counts go to the leaf.
type Tier struct {
	demov1.UnimplementedGatewayServiceServer
	cc   *grpc.ClientConn
	next demov1.GatewayServiceClient
}

// NewTier returns a tier that forwards to next (host:port on loopback)
// through a connection made with dial.
func NewTier(next string, dial []grpc.DialOption) (*Tier, error) {
	if err := CheckLoopback(next); err != nil {
		return nil, fmt.Errorf("stormlab: the next tier: %w", err)
	}
	dial = append(dial[:len(dial):len(dial)], grpc.WithTransportCredentials(insecure.NewCredentials()))
	cc, err := grpc.NewClient(next, dial...)
	if err != nil {
		return nil, err
	}
	return &Tier{cc: cc, next: demov1.NewGatewayServiceClient(cc)}, nil
}

// Charge forwards the request to the next tier.
func (t *Tier) Charge(ctx context.Context, req *demov1.ChargeRequest) (*demov1.ChargeResponse, error) {
	return t.next.Charge(passOn(ctx), req)
}

// Register adds the tier to a new gRPC server made with opts (for
// instance mesh.ServerOptions()).
func (t *Tier) Register(opts ...grpc.ServerOption) *grpc.Server {
	g := grpc.NewServer(opts...)
	demov1.RegisterGatewayServiceServer(g, t)
	return g
}

// Connect connects the tier to the next one and waits until it is ready,
// or ctx ends, so that the first requests do not wait for the connection.
func (t *Tier) Connect(ctx context.Context) { waitReady(ctx, t.cc) }

// Close closes the connection to the next tier.
func (t *Tier) Close() error { return t.cc.Close() }

// TierOptions are a tier process's settings, as its flags give them.
type TierOptions struct {
	Tier     bool    // -tier: serve as a tier (the demo server's switch; a tier binary ignores it)
	Next     string  // -next: the next tier, host:port on loopback
	Strategy string  // -mesh-strategy: the mesh strategy's name (see MeshStrategies)
	Hop      int     // -hop: which hop the tier's client is, 2 to MeshDepth (1: the user's)
	Scale    float64 // -scale: every duration of the strategy is divided by it
	Addr     string  // -addr: the listen address on loopback
	AddrFile string  // -addr-file: also write the address there once listening
	OTLP     string  // -otlp: trace the tier and export its spans over OTLP gRPC to this collector on loopback
}

// LeafService is the service the mesh lab's leaf exports its spans as,
// when traced (MeshLab.OTLP); a tier exports as TierService of its hop.
const LeafService = "leaf"

// TierService is the service name of the tier whose client is hop h:
// "gateway" (h 2) and "service" (h 3, the leaf's caller); "edge" (h 1) is
// the tier an External strategy runs the user's hop in.
func TierService(h int) string {
	switch h {
	case 1:
		return "edge"
	case 2:
		return "gateway"
	case MeshDepth:
		return "service"
	}
	return fmt.Sprintf("tier-%d", h)
}

// RegisterFlags adds the tier's flags to fs; addr says whether to add
// -addr and -addr-file too (a demo server has its own).
func (o *TierOptions) RegisterFlags(fs *flag.FlagSet, addr bool) {
	fs.BoolVar(&o.Tier, "tier", false, "serve as a tier of the mesh lab: forward each charge to -next through the client of -mesh-strategy at -hop")
	fs.StringVar(&o.Next, "next", "", "tier: the next tier (or the leaf), host:port on loopback")
	fs.StringVar(&o.Strategy, "mesh-strategy", "", "tier: the mesh strategy, one of "+MeshStrategyNames())
	fs.IntVar(&o.Hop, "hop", 0, fmt.Sprintf("tier: the hop of the tier's client, 1 to %d (1: the user's)", MeshDepth))
	fs.Float64Var(&o.Scale, "scale", 1, "tier: divide every duration of the strategy by this")
	if addr {
		fs.StringVar(&o.Addr, "addr", "127.0.0.1:0", "listen address on loopback; port 0 picks one and prints it")
		fs.StringVar(&o.AddrFile, "addr-file", "", "also write the address to this file once listening")
		fs.StringVar(&o.OTLP, "otlp", "", "trace the tier (as service "+strconv.Quote(TierService(2))+" or "+strconv.Quote(TierService(MeshDepth))+", by -hop) and export the spans over OTLP gRPC to this collector on loopback (host:port)")
	}
}

// TierPeers are the clients of the mesh strategies with an External name
// that a tier binary has, by that name: each returns the dial options of
// a hop's client for the scenario, scaled (as Strategy.Peer does).
type TierPeers map[string]func(sc Scenario) []grpc.DialOption

// RunTier serves the tier o describes on o.Addr until ctx ends, then stops
// the server (gracefully, for at most 2 s). It prints the address it
// listens on to out and, with o.AddrFile, writes it there once the tier's
// connection to the next one is ready. peers are the external clients the
// binary has. With o.OTLP, the tier traces what it serves (otelgrpc's
// server handler, continuing the caller's trace) and what it sends on
// (herdguard's call, attempt and backoff spans, otelgrpc's client span
// under each attempt), as service TierService(o.Hop), and flushes the
// spans before it returns.
func RunTier(ctx context.Context, o TierOptions, peers TierPeers, out io.Writer) (err error) {
	if err := CheckLoopback(o.Addr); err != nil {
		return fmt.Errorf("-addr: %w", err)
	}
	ms, ok := MeshStrategyNamed(o.Strategy)
	if !ok {
		return fmt.Errorf("-mesh-strategy %q: want one of %s", o.Strategy, MeshStrategyNames())
	}
	if o.Hop < 1 || o.Hop > MeshDepth {
		return fmt.Errorf("-hop %d: want 1 to %d", o.Hop, MeshDepth)
	}
	if o.Scale <= 0 {
		return fmt.Errorf("-scale %v: must be positive", o.Scale)
	}
	var tp trace.TracerProvider
	var serverOpts []grpc.ServerOption
	if o.OTLP != "" {
		exp, sdk, err := NewExporter(ctx, TierService(o.Hop), o.OTLP)
		if err != nil {
			return fmt.Errorf("-otlp: %w", err)
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err = errors.Join(err, exp.Shutdown(sctx))
		}()
		tp = sdk
		serverOpts = append(serverOpts, ServerTracing(tp))
	}
	dial, _, err := ms.hopClient(o.Hop, o.Scale, peers, tp)
	if err != nil {
		return err
	}
	if tp != nil {
		dial = append(dial, ClientTracing(tp))
	}
	t, err := NewTier(o.Next, dial)
	if err != nil {
		return fmt.Errorf("-next: %w", err)
	}
	defer t.Close()
	lis, err := net.Listen("tcp", o.Addr)
	if err != nil {
		return err
	}
	g := t.Register(append(serverOpts, ms.serverOptions()...)...)
	served := make(chan error, 1)
	go func() { served <- g.Serve(lis) }()
	t.Connect(ctx)
	fmt.Fprintf(out, "tier %d (%s) listening on %s, forwarding to %s\n", o.Hop, ms.Name, lis.Addr(), o.Next)
	if o.AddrFile != "" {
		if err := os.WriteFile(o.AddrFile, []byte(lis.Addr().String()), 0o600); err != nil {
			g.Stop()
			<-served
			return err
		}
	}
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	done := make(chan struct{})
	go func() { g.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		g.Stop()
		<-done
	}
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}
