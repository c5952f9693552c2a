package main

import (
	"strings"
	"testing"

	"github.com/herdguard/herdguard/internal/stormlab"
)

func TestRefusesToListenBeyondLoopback(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", "10.0.0.1:7000", ":7000", "nohost"} {
		err := run(addr, "", stormlab.Faults{})
		if err == nil || !strings.Contains(err.Error(), addr) {
			t.Errorf("run(%q) = %v, want an error naming the address", addr, err)
		}
	}
	if err := run("127.0.0.1:0", "", stormlab.Faults{FailRate: 2}); err == nil || !strings.Contains(err.Error(), "fail rate 2") {
		t.Errorf("bad faults: %v", err)
	}
}
