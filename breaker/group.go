package breaker

import "github.com/herdguard/herdguard/internal/cow"

// Group holds the breakers of one interceptor, one per scope, made on first
// use. It is safe for concurrent use; finding an existing breaker takes no
// lock and allocates nothing.
type Group struct {
	settings Settings
	breakers cow.Map[key, *Breaker]
}

type key struct{ target, method string }

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
	return g.breakers.Get(k, func() *Breaker { return newBreaker(k.target+k.method, g.settings) })
}

// Each calls fn for every breaker made so far, in no set order.
func (g *Group) Each(fn func(*Breaker)) {
	g.breakers.Range(func(_ key, b *Breaker) { fn(b) })
}
