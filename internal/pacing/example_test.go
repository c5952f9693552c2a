package pacing_test

import (
	"context"
	"fmt"

	"github.com/herdguard/herdguard/internal/pacing"
	"github.com/herdguard/herdguard/overload"
)

// A controller per target: ask before each attempt, report how it ended.
// While the server answers nothing waits; once refusals for load dominate
// an interval, attempts are paced.
func Example() {
	ctl, err := pacing.New(overload.Settings{}, pacing.Clock{}) // every default, real time
	if err != nil {
		panic(err) // a bad setting is an error that names it
	}
	send := func(refused bool) {
		if _, err := ctl.Acquire(context.Background()); err != nil {
			return // shed, or the context ended: nothing was sent
		}
		if refused { // Unavailable, ResourceExhausted, an attempt timed out
			ctl.Done(pacing.Overloaded)
		} else { // any answer, errors included
			ctl.Answered()
		}
	}
	for range 10 {
		send(false)
	}
	fmt.Println("pacing after answers:", ctl.Pacing())
	for range 30 { // 30 of 40: clearly more than half
		send(true)
	}
	fmt.Println("pacing after a burst of refusals:", ctl.Pacing())
	// Output:
	// pacing after answers: false
	// pacing after a burst of refusals: true
}
