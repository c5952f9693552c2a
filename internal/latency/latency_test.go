package latency

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ms = time.Millisecond

func TestQuantileUnknownUntilEnoughSamples(t *testing.T) {
	w := New(0.95, 32)
	for i := range 31 {
		w.Record(time.Duration(i+1) * ms)
		if _, known := w.Quantile(); known {
			t.Fatalf("known after %d latencies, want 32", i+1)
		}
	}
	w.Record(32 * ms)
	q, known := w.Quantile()
	// nearest rank: ceil(0.95*32) = 31st smallest of 1..32 ms
	if !known || q != 31*ms {
		t.Errorf("after 32 latencies: %v, %v; want 31ms, true", q, known)
	}
}

func TestQuantileExact(t *testing.T) {
	for _, tc := range []struct {
		q    float64
		n    int
		want time.Duration
	}{
		{0.5, 100, 50 * ms},
		{0.95, 100, 95 * ms},
		{0.99, 100, 99 * ms},
		{0.95, 64, 61 * ms}, // ceil(60.8) = 61
	} {
		w := New(tc.q, 16)
		order := rand.New(rand.NewPCG(1, 2)).Perm(tc.n) // order must not matter
		for _, i := range order {
			w.Record(time.Duration(i+1) * ms)
		}
		// the last computation was at the last multiple of Refresh
		counted := tc.n / Refresh * Refresh
		recorded := make([]time.Duration, counted)
		for j, i := range order[:counted] {
			recorded[j] = time.Duration(i+1) * ms
		}
		slices.Sort(recorded)
		want := recorded[ceilRank(tc.q, counted)-1]
		if got, _ := w.Quantile(); got != want {
			t.Errorf("q=%v over %d latencies: %v, want %v (the nearest rank of the %d counted)", tc.q, tc.n, got, want, counted)
		}
		if counted == tc.n && want != tc.want {
			t.Errorf("q=%v over %d latencies: the table wants %v, the nearest rank is %v", tc.q, tc.n, tc.want, want)
		}
	}
}

func ceilRank(q float64, m int) int {
	k := int(q * float64(m))
	if float64(k) < q*float64(m) {
		k++
	}
	return k
}

// TestOnlyRecentLatenciesCount: once the ring is full, old latencies fall
// out; a method that got slow is seen slow within Size attempts.
func TestOnlyRecentLatenciesCount(t *testing.T) {
	w := New(0.5, 16)
	for range 10 * Size {
		w.Record(ms)
	}
	for range Size {
		w.Record(100 * ms)
	}
	if q, _ := w.Quantile(); q != 100*ms {
		t.Errorf("median after %d slow attempts: %v, want 100ms", Size, q)
	}
}

func TestSelectKth(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		s := make([]int64, 1+rng.IntN(300))
		for i := range s {
			s[i] = int64(rng.IntN(50)) // with repeats
		}
		sorted := slices.Sorted(slices.Values(s))
		k := rng.IntN(len(s))
		if got := selectKth(slices.Clone(s), k); got != sorted[k] {
			t.Fatalf("selectKth(%v, %d) = %d, want %d", s, k, got, sorted[k])
		}
	}
}

// TestConcurrentRecord records from many goroutines at once (run with
// -race) and checks the result is one of the recorded latencies' quantile
// range.
func TestConcurrentRecord(t *testing.T) {
	w := New(0.95, 32)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 1000 {
				w.Record(time.Duration(g*1000+i) * time.Microsecond)
				w.Quantile()
			}
		})
	}
	wg.Wait()
	q, known := w.Quantile()
	if !known || q <= 0 || q >= 8*time.Millisecond {
		t.Errorf("quantile %v, %v; want a known latency among those recorded", q, known)
	}
}

func TestRecordAllocatesNothing(t *testing.T) {
	w := New(0.95, 32)
	if n := testing.AllocsPerRun(1000, func() { w.Record(ms) }); n != 0 {
		t.Errorf("Record: %v allocations, want 0", n)
	}
}

func BenchmarkRecord(b *testing.B) {
	w := New(0.95, 32)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		w.Record(time.Duration(i%1000) * time.Microsecond)
	}
}
