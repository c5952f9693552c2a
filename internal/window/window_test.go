package window

import (
	"testing"
	"time"
)

// TestPairRolls: events leave the window a bucket at a time, about a
// window after they came; a gap longer than the window empties it; a
// clock that reads earlier than the newest bucket counts there.
func TestPairRolls(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	p := NewPair(10*time.Second, t0)
	p.Add(at(0), 2, 0)                     // bucket 0
	p.Add(at(6*time.Second), 0, 1)         // bucket 6
	p.Add(at(9999*time.Millisecond), 1, 1) // bucket 9
	for _, tc := range []struct {
		now  time.Duration
		a, b int64
	}{
		{9 * time.Second, 3, 2},
		{10 * time.Second, 1, 2}, // bucket 0 left: 10 s after its start
		{16 * time.Second, 1, 1}, // bucket 6 left
		{20 * time.Second, 0, 0}, // bucket 9 left
		{15 * time.Second, 0, 0}, // an earlier reading changes nothing
		{time.Hour, 0, 0},
	} {
		if a, b := p.Sums(at(tc.now)); a != tc.a || b != tc.b {
			t.Errorf("at %v: sums %d, %d; want %d, %d", tc.now, a, b, tc.a, tc.b)
		}
	}
	p.Add(at(time.Hour-time.Minute), 5, 0) // behind the newest bucket: counts in it
	if a, _ := p.Sums(at(time.Hour)); a != 5 {
		t.Errorf("an event read behind the newest bucket: sum %d, want 5", a)
	}
}
