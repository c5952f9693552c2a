package main

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

func TestRefusesToListenBeyondLoopback(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", "10.0.0.1:7000", ":7000", "nohost"} {
		err := run(addr, "", "", stormlab.Faults{})
		if err == nil || !strings.Contains(err.Error(), addr) {
			t.Errorf("run(%q) = %v, want an error naming the address", addr, err)
		}
	}
	if err := run("127.0.0.1:0", "", "", stormlab.Faults{FailRate: 2}); err == nil || !strings.Contains(err.Error(), "FailRate = 2") {
		t.Errorf("bad faults: %v", err)
	}
}

func TestOTLPCollectorMustListen(t *testing.T) {
	// a port that nothing listens on: taken, then freed
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	free := lis.Addr().String()
	lis.Close()
	for _, otlp := range []string{"192.168.1.1:4317", free} {
		began := time.Now()
		err := run("127.0.0.1:0", "", otlp, stormlab.Faults{})
		if err == nil || !strings.Contains(err.Error(), "-otlp") || !strings.Contains(err.Error(), otlp) {
			t.Errorf("run with -otlp %s = %v, want an error naming the flag and the endpoint", otlp, err)
		}
		if d := time.Since(began); d > 3*time.Second {
			t.Errorf("run with -otlp %s took %v to fail", otlp, d)
		}
	}
}
