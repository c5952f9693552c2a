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
		{Settings{Now: time.Now}, "Now and AfterFunc"},
	} {
		_, err := New(tc.s)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want an error containing %q", tc.s, err, tc.want)
		}
	}
	if _, err := New(Settings{}); err != nil {
		t.Errorf("the zero Settings: %v", err)
	}
}
