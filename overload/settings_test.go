package overload

import (
	"strings"
	"testing"
	"time"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		s    Settings
		want string
	}{
		{Settings{Interval: -1}, "Interval = -1ns"},
		{Settings{MinFailures: -2}, "MinFailures = -2"},
		{Settings{FailureRatio: 1.5}, "FailureRatio = 1.5"},
		{Settings{Hold: -time.Second}, "Hold = -1s"},
		{Settings{Calm: -1}, "Calm = -1"},
		{Settings{Headroom: 2}, "Headroom = 2"},
	} {
		err := tc.s.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), "herdguard: overload: ") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want an error naming %q", tc.s, err, tc.want)
		}
	}
	if err := (Settings{}).Validate(); err != nil {
		t.Errorf("the zero Settings: %v", err)
	}
	d := Settings{}.WithDefaults()
	if d.Interval != DefaultInterval || d.MinFailures != DefaultMinFailures || d.FailureRatio != DefaultFailureRatio ||
		d.Hold != DefaultHold || d.Calm != DefaultCalm || d.Headroom != DefaultHeadroom {
		t.Errorf("Settings{}.WithDefaults() = %+v, want every default", d)
	}
	if got := (Settings{Interval: time.Second}).WithDefaults().Interval; got != time.Second {
		t.Errorf("WithDefaults changed a field set: Interval %v", got)
	}
}
