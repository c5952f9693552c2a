// Package errs makes herdguard's error messages: each starts with Prefix,
// once, however many of herdguard's errors it wraps.
package errs

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Prefix starts every message of an error herdguard returns.
const Prefix = "herdguard: "

// New returns an error whose message is Prefix and msg.
func New(msg string) error { return errors.New(Prefix + msg) }

// Errorf is fmt.Errorf with Prefix before the message. A herdguard error
// among the arguments is written without its own Prefix, and still
// wrapped by %w: "herdguard: interceptor: WithPolicy: policy: ...".
func Errorf(format string, args ...any) error {
	args = slices.Clone(args)
	for i, a := range args {
		if err, ok := a.(error); ok && strings.HasPrefix(err.Error(), Prefix) {
			args[i] = inner{err}
		}
	}
	return fmt.Errorf(Prefix+format, args...)
}

// inner is a herdguard error written inside another: its message without
// Prefix.
type inner struct{ err error }

func (e inner) Error() string { return strings.TrimPrefix(e.err.Error(), Prefix) }
func (e inner) Unwrap() error { return e.err }
