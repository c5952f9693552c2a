// Package herdguard holds what a gRPC status code means to a retrying
// client: whether a failed attempt is worth another try, and whether a final
// result says the server is failing (so a circuit breaker should count it) or
// healthy.
//
// The interceptors themselves live in the interceptor package; the retry
// policy in policy and the circuit breaker in breaker.
//
// # Status codes
//
// Retryable by default ([DefaultRetryableCodes]): Unavailable and
// ResourceExhausted. Both say "not now", never "not ever".
//
// For the circuit breaker ([BreakerVerdict]) a call's final code is one of:
//
//	code                 breaker verdict   why
//	OK                   success           the server answered
//	InvalidArgument      success           the caller's mistake; the server is fine
//	NotFound             success           "
//	AlreadyExists        success           "
//	PermissionDenied     success           "
//	Unauthenticated      success           "
//	FailedPrecondition   success           "
//	OutOfRange           success           "
//	Unimplemented        success           "
//	Aborted              success           a conflict the server detected
//	Unavailable          failure           the server could not be reached or refused work
//	DeadlineExceeded     failure           an attempt timed out (see below)
//	ResourceExhausted    failure           the server is overloaded
//	Internal             failure           the server broke
//	Unknown              failure           "
//	DataLoss             failure           "
//	Canceled             ignored           the caller gave up; says nothing of the server
//	any other number     failure           treated as Unknown
//
// A DeadlineExceeded that comes from the caller's own context is judged by
// when it ran out: while an attempt was in flight, the server did not answer
// in time, and the table applies (failure); during a backoff wait, or
// before the first attempt, it says nothing of the server, like Canceled,
// and the interceptor reports it as [Ignored]. breaker.Settings.Verdict
// replaces the table.
package herdguard

import (
	"strconv"

	"google.golang.org/grpc/codes"
)

// DefaultRetryableCodes returns the codes retried when a policy names none:
// Unavailable and ResourceExhausted. Each call returns a fresh slice that the
// caller may change.
func DefaultRetryableCodes() []codes.Code {
	return []codes.Code{codes.Unavailable, codes.ResourceExhausted}
}

// Verdict is what one finished logical call tells a circuit breaker.
type Verdict uint8

const (
	// Success says the server is healthy: it answered, even if with an error
	// that is the caller's fault.
	Success Verdict = iota
	// Failure says the server is failing or unreachable.
	Failure
	// Ignored says nothing about the server, as when the caller cancelled.
	Ignored
)

// String returns "success", "failure" or "ignored".
func (v Verdict) String() string {
	switch v {
	case Success:
		return "success"
	case Failure:
		return "failure"
	case Ignored:
		return "ignored"
	}
	return "Verdict(" + strconv.Itoa(int(v)) + ")"
}

// BreakerVerdict reports what a call's final status code says about the
// server, following the table in the package documentation.
func BreakerVerdict(c codes.Code) Verdict {
	switch c {
	case codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.PermissionDenied, codes.Unauthenticated, codes.FailedPrecondition,
		codes.OutOfRange, codes.Unimplemented, codes.Aborted:
		return Success
	case codes.Canceled:
		return Ignored
	}
	return Failure
}

// IsServerFailure reports whether c, as a call's final code, counts as a
// server failure for the circuit breaker.
func IsServerFailure(c codes.Code) bool { return BreakerVerdict(c) == Failure }

// CodeName returns the code's name as gRPC's specification spells it
// ("UNAVAILABLE"), which is also how service configs and the semantic
// conventions write it. A code gRPC does not define is "UNKNOWN".
func CodeName(c codes.Code) string {
	if IsKnownCode(c) {
		return codeNames[c]
	}
	return "UNKNOWN"
}

var codeNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
	"NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
	"FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
	"INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}

// IsKnownCode reports whether c is one of the 17 codes gRPC defines.
func IsKnownCode(c codes.Code) bool { return c <= codes.Unauthenticated }
