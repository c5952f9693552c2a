// Package cow is a copy-on-write map for values made once per key and read
// on every call: a read takes no lock and allocates nothing.
package cow

import (
	"maps"
	"sync"
	"sync/atomic"
)

// Map maps keys to values made on first use. The zero Map is empty and
// ready to use.
type Map[K comparable, V any] struct {
	// m is replaced, never changed, so readers need no lock.
	m  atomic.Pointer[map[K]V]
	mu sync.Mutex // serialises writers
}

// Get returns the value for k, calling make once to create it if absent.
func (c *Map[K, V]) Get(k K, make func() V) V {
	if m := c.m.Load(); m != nil {
		if v, ok := (*m)[k]; ok {
			return v
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var next map[K]V
	if m := c.m.Load(); m != nil {
		if v, ok := (*m)[k]; ok {
			return v
		}
		next = maps.Clone(*m)
	} else {
		next = map[K]V{}
	}
	v := make()
	next[k] = v
	c.m.Store(&next)
	return v
}

// Range calls fn for every entry, in no set order.
func (c *Map[K, V]) Range(fn func(K, V)) {
	if m := c.m.Load(); m != nil {
		for k, v := range *m {
			fn(k, v)
		}
	}
}

// Len returns the number of entries.
func (c *Map[K, V]) Len() int {
	if m := c.m.Load(); m != nil {
		return len(*m)
	}
	return 0
}
