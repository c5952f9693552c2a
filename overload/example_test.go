package overload_test

import (
	"fmt"
	"time"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/overload"
)

// A server whose refusals come in larger numbers before they mean
// overload: count over longer intervals and ask for more refusals. An
// unusable value is an error that names the field.
func ExampleSettings() {
	s := overload.Settings{Interval: 250 * time.Millisecond, MinFailures: 50}
	ic, err := interceptor.New(interceptor.WithOverloadControl(s))
	fmt.Println(ic != nil, err)
	fmt.Println(s.WithDefaults().FailureRatio, overload.Settings{FailureRatio: 2}.Validate())
	// Output:
	// true <nil>
	// 0.5 herdguard: overload: FailureRatio = 2: must be in [0, 1]
}
