package breaker

import (
	"maps"
	"sync"
	"sync/atomic"
)

// Group holds the breakers of one interceptor, one per scope, made on first
// use. It is safe for concurrent use; finding an existing breaker takes no
// lock and allocates nothing.
type Group struct {
	settings Settings
	// breakers is replaced, never changed, so readers need no lock.
	breakers atomic.Pointer[map[key]*Breaker]

	mu sync.Mutex // serialises writers of breakers
}

type key struct{ target, method string }

// NewGroup validates s and returns an empty group.
func NewGroup(s Settings) (*Group, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	g := &Group{settings: s.WithDefaults()}
	g.breakers.Store(&map[key]*Breaker{})
	return g, nil
}

// Settings returns the group's settings, defaults filled in.
func (g *Group) Settings() Settings { return g.settings }

// Get returns the breaker for a call of fullMethod on target: one per target,
// or one per target and method when the scope is PerMethod.
func (g *Group) Get(target, fullMethod string) *Breaker {
	k := key{target: target}
	if g.settings.Scope == PerMethod {
		k.method = fullMethod
	}
	if b, ok := (*g.breakers.Load())[k]; ok {
		return b
	}
	return g.create(k)
}

func (g *Group) create(k key) *Breaker {
	g.mu.Lock()
	defer g.mu.Unlock()
	old := *g.breakers.Load()
	if b, ok := old[k]; ok {
		return b
	}
	b := newBreaker(k.target+k.method, g.settings)
	next := maps.Clone(old)
	next[k] = b
	g.breakers.Store(&next)
	return b
}

// Each calls fn for every breaker made so far, in no set order.
func (g *Group) Each(fn func(*Breaker)) {
	for _, b := range *g.breakers.Load() {
		fn(b)
	}
}
