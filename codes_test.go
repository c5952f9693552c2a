package herdguard_test

import (
	"strconv"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard"
)

func TestDefaultRetryableCodesIsFresh(t *testing.T) {
	a := herdguard.DefaultRetryableCodes()
	want := []codes.Code{codes.Unavailable, codes.ResourceExhausted}
	if len(a) != len(want) || a[0] != want[0] || a[1] != want[1] {
		t.Fatalf("DefaultRetryableCodes() = %v, want %v", a, want)
	}
	a[0] = codes.Internal
	if b := herdguard.DefaultRetryableCodes(); b[0] != codes.Unavailable {
		t.Fatalf("changing a returned slice changed the defaults: got %v", b)
	}
}

func TestBreakerVerdict(t *testing.T) {
	tests := []struct {
		code codes.Code
		want herdguard.Verdict
	}{
		{codes.OK, herdguard.Success},
		{codes.InvalidArgument, herdguard.Success},
		{codes.NotFound, herdguard.Success},
		{codes.AlreadyExists, herdguard.Success},
		{codes.PermissionDenied, herdguard.Success},
		{codes.Unauthenticated, herdguard.Success},
		{codes.FailedPrecondition, herdguard.Success},
		{codes.OutOfRange, herdguard.Success},
		{codes.Unimplemented, herdguard.Success},
		{codes.Aborted, herdguard.Success},
		{codes.Unavailable, herdguard.Failure},
		{codes.DeadlineExceeded, herdguard.Failure},
		{codes.ResourceExhausted, herdguard.Failure},
		{codes.Internal, herdguard.Failure},
		{codes.Unknown, herdguard.Failure},
		{codes.DataLoss, herdguard.Failure},
		{codes.Canceled, herdguard.Ignored},
		{codes.Code(99), herdguard.Failure},
	}
	for _, tt := range tests {
		t.Run(tt.code.String(), func(t *testing.T) {
			if got := herdguard.BreakerVerdict(tt.code); got != tt.want {
				t.Errorf("BreakerVerdict(%v) = %v, want %v", tt.code, got, tt.want)
			}
			if got, want := herdguard.IsServerFailure(tt.code), tt.want == herdguard.Failure; got != want {
				t.Errorf("IsServerFailure(%v) = %v, want %v", tt.code, got, want)
			}
		})
	}
}

func TestVerdictString(t *testing.T) {
	for v, want := range map[herdguard.Verdict]string{
		herdguard.Success: "success", herdguard.Failure: "failure",
		herdguard.Ignored: "ignored", herdguard.Verdict(7): "Verdict(7)",
	} {
		if got := v.String(); got != want {
			t.Errorf("Verdict(%d).String() = %q, want %q", v, got, want)
		}
	}
}

func TestIsKnownCode(t *testing.T) {
	if !herdguard.IsKnownCode(codes.Unauthenticated) || !herdguard.IsKnownCode(codes.OK) {
		t.Error("IsKnownCode rejected a code gRPC defines")
	}
	if herdguard.IsKnownCode(codes.Code(17)) {
		t.Error("IsKnownCode(17) = true, want false")
	}
}

// TestCodeNames: CodeName spells every code as gRPC's own parser of
// service-config names (codes.Code's UnmarshalJSON) reads it.
func TestCodeNames(t *testing.T) {
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		name := herdguard.CodeName(c)
		var got codes.Code
		if err := got.UnmarshalJSON([]byte(strconv.Quote(name))); err != nil || got != c {
			t.Errorf("CodeName(%v) = %q, which gRPC reads as %v, %v", c, name, got, err)
		}
	}
	if herdguard.CodeName(codes.Unavailable) != "UNAVAILABLE" || herdguard.CodeName(codes.Canceled) != "CANCELLED" || herdguard.CodeName(99) != "UNKNOWN" {
		t.Error("CodeName spells codes wrong")
	}
}
