package cow

import (
	"sync"
	"sync/atomic"
	"testing"
)

func TestGetMakesOncePerKey(t *testing.T) {
	var m Map[string, *int]
	var made atomic.Int32
	mk := func() *int { made.Add(1); return new(int) }
	got := make([]*int, 100)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() { got[i] = m.Get("k", mk) })
	}
	wg.Wait()
	for _, p := range got {
		if p != got[0] {
			t.Fatal("two callers got different values for one key")
		}
	}
	if made.Load() != 1 {
		t.Errorf("make ran %d times, want 1", made.Load())
	}
	m.Get("other", mk)
	n := 0
	m.Range(func(string, *int) { n++ })
	if n != 2 || m.Len() != 2 {
		t.Errorf("Range saw %d, Len %d; want 2", n, m.Len())
	}
}

func TestGetAllocatesNothingWhenPresent(t *testing.T) {
	var m Map[string, int]
	m.Get("k", func() int { return 1 })
	if a := testing.AllocsPerRun(100, func() { m.Get("k", nil) }); a != 0 {
		t.Errorf("Get of a present key allocates %v times", a)
	}
}
