package errs

import (
	"errors"
	"io"
	"testing"
)

type codeErr struct{ code int }

func (e *codeErr) Error() string { return Prefix + "code" }

func TestErrorf(t *testing.T) {
	base := Errorf("policy: Multiplier = %v: must be at least 1", 0.5)
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"new", New("circuit breaker is open"), "herdguard: circuit breaker is open"},
		{"own", base, "herdguard: policy: Multiplier = 0.5: must be at least 1"},
		{"wrapping one of ours", Errorf("interceptor: WithPolicy: %w", base), "herdguard: interceptor: WithPolicy: policy: Multiplier = 0.5: must be at least 1"},
		{"twice", Errorf("a: %w", Errorf("b: %w", base)), "herdguard: a: b: policy: Multiplier = 0.5: must be at least 1"},
		{"wrapping another's", Errorf("reading: %w", io.EOF), "herdguard: reading: EOF"},
		{"a %v of ours", Errorf("x: %v", base), "herdguard: x: policy: Multiplier = 0.5: must be at least 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.err.Error(); got != tc.want {
				t.Errorf("message %q, want %q", got, tc.want)
			}
		})
	}
	if err := Errorf("a: %w", Errorf("b: %w", base)); !errors.Is(err, base) {
		t.Error("errors.Is does not find the wrapped error")
	}
	var ce *codeErr
	if err := Errorf("call: %w", &codeErr{7}); !errors.As(err, &ce) || ce.code != 7 {
		t.Error("errors.As does not find the wrapped error's type")
	}
	if err := Errorf("reading: %w", io.EOF); !errors.Is(err, io.EOF) {
		t.Error("errors.Is does not find another's error")
	}
}
