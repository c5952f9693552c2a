package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

func TestMeshRejectsBadFlags(t *testing.T) {
	base := options{mesh: true, serverBin: "/nonexistent/demo-server", scale: 1, runs: 1}
	tests := []struct {
		name string
		edit func(*options)
		want string
	}{
		{"no server binary", func(o *options) { o.serverBin = "" }, "-server-bin"},
		{"zero scale", func(o *options) { o.scale = 0 }, "-scale"},
		{"unknown scenario", func(o *options) { o.scenario = "steady-cut,tsunami" }, `"tsunami"`},
		{"unknown strategy", func(o *options) { o.meshStrategies = "pray" }, `"pray"`},
		{"go-grpc-middleware without its binary", func(o *options) { o.meshStrategies = stormlab.MeshGGM }, "-ggm-tier-bin"},
		{"a binary that is not there", func(o *options) { o.meshStrategies = stormlab.MeshNoRetries }, "start the chain"},
		{"-trace without Jaeger", func(o *options) { o.trace = true }, "-otlp and -jaeger"},
		{"-trace-svg without Jaeger", func(o *options) { o.traceSVG, o.otlp = "t.svg", "127.0.0.1:4317" }, "-otlp and -jaeger"},
		{"-otlp off loopback", func(o *options) { o.otlp = "192.0.2.1:4317" }, "loopback"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := base
			tt.edit(&o)
			err := run(context.Background(), o, &bytes.Buffer{}, &bytes.Buffer{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run = %v, want an error naming %s", err, tt.want)
			}
		})
	}
}

func TestMeshLeavesOutGGMWithoutItsBinary(t *testing.T) {
	var progress bytes.Buffer
	got, err := pickMeshStrategies(options{}, &progress)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(stormlab.MeshStrategies())-1 || !strings.Contains(progress.String(), stormlab.MeshGGM) {
		t.Errorf("%d strategies, progress %q: want all but go-grpc-middleware's, and a note saying so", len(got), progress.String())
	}
	got, _ = pickMeshStrategies(options{ggmTierBin: "bin/ggm-tier"}, &progress)
	if len(got) != len(stormlab.MeshStrategies()) {
		t.Errorf("with -ggm-tier-bin: %d strategies, want all", len(got))
	}
}
