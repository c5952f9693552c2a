package breaker

import (
	"sync/atomic"

	"github.com/herdguard/herdguard/internal/cow"
)

// Group holds the breakers of one interceptor, one per scope, made on first
// use. It is safe for concurrent use; finding an existing breaker takes no
// lock and allocates nothing.
type Group struct {
	settings Settings
	breakers cow.Map[key, *entry]
	// last is the last breaker found: most interceptors call one target,
	// often one method, and comparing its key is cheaper than the map's
	// hashing of two strings.
	last atomic.Pointer[entry]
}

type key struct{ target, method string }

// entry is a breaker with its key, as the map holds it; never changed.
type entry struct {
	k key
	b *Breaker
}

// NewGroup validates s and returns an empty group.
func NewGroup(s Settings) (*Group, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &Group{settings: s.WithDefaults()}, nil
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
	if e := g.last.Load(); e != nil && e.k == k {
		return e.b
	}
	return g.find(k)
}

// find is Get past the last breaker found.
func (g *Group) find(k key) *Breaker {
	e := g.breakers.Get(k, func() *entry { return &entry{k, newBreaker(k.target+k.method, g.settings)} })
	g.last.Store(e) // no allocation: a caller that alternates scopes pays the map only
	return e.b
}

// Each calls fn for every breaker made so far, in no set order.
func (g *Group) Each(fn func(*Breaker)) {
	g.breakers.Range(func(_ key, e *entry) { fn(e.b) })
}
