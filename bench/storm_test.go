package bench

import (
	"context"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/internal/stormlab"
)

// stormScale shortens the storm comparison: windows of 50 ms.
const stormScale = 2

// TestStormTable drives the storm lab's load-dependent overload through
// go-grpc-middleware's exponential backoff with jitter, gRPC's built-in
// retry (with gRFC A6's throttling), herdguard's defaults (full jitter and
// the breaker) and the same with a retry budget, and prints one table. It runs only when
// HERDGUARD_STORM=1 (make bench sets it): it takes about a minute.
func TestStormTable(t *testing.T) {
	if os.Getenv("HERDGUARD_STORM") != "1" {
		t.Skip("set HERDGUARD_STORM=1 to run the storm comparison")
	}
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	sc := stormlab.Overload()
	scaled := sc.Scale(stormScale)
	r := &stormlab.Runner{Addr: addr}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	var results []stormlab.Result
	for _, p := range []struct {
		name string
		dial []grpc.DialOption
	}{
		{"go-grpc-middleware retry", []grpc.DialOption{grpc.WithChainUnaryInterceptor(ggmRetry(t, scaled.Attempts, scaled.Base))}},
		{"gRPC built-in retry", []grpc.DialOption{grpc.WithDefaultServiceConfig(grpcRetryConfig(scaled.Attempts, scaled.Base, true))}},
	} {
		res, err := r.RunClient(ctx, scaled, p.name, p.dial, nil)
		if err != nil {
			t.Fatal(err)
		}
		results = append(results, res)
	}
	for _, st := range []stormlab.Strategy{stormlab.Strategies(sc)[len(stormlab.Strategies(sc))-1], stormlab.BudgetStrategy(sc)} {
		res, err := r.Run(ctx, sc, st, stormScale)
		if err != nil {
			t.Fatal(err)
		}
		results = append(results, res)
	}
	if err := stormlab.WriteTable(os.Stdout, results); err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("\n" + stormlab.Legend + "\n")

	// What must hold: fewer attempts and a lower worst window than the
	// peer that retries without a budget. The rest is reported, not graded.
	hg, ggm := results[len(results)-1], results[0]
	if hg.Stats.GetAttempts() >= ggm.Stats.GetAttempts() || hg.Stats.GetPeakRetriesSliding() >= ggm.Stats.GetPeakRetriesSliding() {
		t.Errorf("herdguard sent %d attempts (peak retries %d), %s %d (peak %d): want fewer and lower",
			hg.Stats.GetAttempts(), hg.Stats.GetPeakRetriesSliding(), ggm.Strategy, ggm.Stats.GetAttempts(), ggm.Stats.GetPeakRetriesSliding())
	}
}
