package pacing

import (
	"context"
	"testing"

	"github.com/herdguard/herdguard/overload"
)

// BenchmarkCalmAttempt is what a calm target's attempt costs: Acquire
// before, AnsweredSentCalm after (as the interceptor reports it).
func BenchmarkCalmAttempt(b *testing.B) {
	c, err := New(overload.Settings{}, Clock{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Acquire(ctx); err != nil {
			b.Fatal(err)
		}
		c.AnsweredSentCalm()
	}
}
