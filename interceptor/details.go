package interceptor

import (
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// details is what a failed attempt's status says beyond its code, in the
// google.rpc details servers attach to it.
type details struct {
	// retryInfo: the status carries a google.rpc.RetryInfo, whose
	// retry_delay (retryDelay) is the least the next attempt waits; later
	// waits grow from it, as the detail's documentation asks.
	retryInfo  bool
	retryDelay time.Duration
	// quota: a RESOURCE_EXHAUSTED that carries a google.rpc.QuotaFailure:
	// the caller ran out of its own quota, which says nothing of the
	// server's load or health. Neither the breaker nor the overload
	// controller counts it.
	quota bool
}

// detailsOf reads err's status details. A status without details, as most
// are, costs no allocation.
func detailsOf(err error) (d details) {
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return d
	}
	for _, x := range st.Details() {
		switch x := x.(type) {
		case *errdetails.RetryInfo:
			if x.GetRetryDelay() != nil {
				d.retryInfo, d.retryDelay = true, max(x.GetRetryDelay().AsDuration(), 0)
			}
		case *errdetails.QuotaFailure:
			d.quota = st.Code() == codes.ResourceExhausted
		}
	}
	return d
}

// quotaFailure reports whether err is a caller's quota running out (see
// details.quota).
func quotaFailure(err error) bool {
	return status.Code(err) == codes.ResourceExhausted && detailsOf(err).quota
}
