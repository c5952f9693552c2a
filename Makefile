# herdguard: `make demo` shows a retry storm and what tames it; `make test`
# runs every test. Both need nothing but Go (and a C compiler for -race).

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

BIN := $(CURDIR)/bin
GO ?= go

# Tools, pinned, installed into ./bin by `go install` when a target needs them.
BUF_VERSION                := v1.75.0
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
BENCHSTAT_VERSION          := v0.0.0-20260908200009-22c9c6c9d4da

# Demo knobs: make demo DEMO_ARGS='-compare -scale 1' reproduces the published
# times (about 5 minutes); the default scale finishes in under a minute.
DEMO_ARGS ?= -compare -scale 4 -svg $(BIN)/storm.svg
TRACE_ARGS ?= -strategy "herdguard defaults" -calls 100 -scale 4 -trace
# make trace-demo TRACE_DEMO_ARGS='-keep' keeps Jaeger up afterwards.
TRACE_DEMO_ARGS ?=
# make fleet-demo FLEET_ARGS='-runs 1 -scale 4' for a quick look.
FLEET_ARGS ?=
BENCH_COUNT ?= 5
BENCH_OUT := .bench

.PHONY: help
help: ## Show the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z0-9-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# -p 1: one package at a time. The storm lab's end-to-end tests count
# arrivals in 67 ms windows; other test binaries competing for the cores
# would spread a herd of calls across windows.
.PHONY: test
test: ## Run every test but the timing ones with the race detector, then the allocation tests without it (make timing runs the timing tests)
	$(GO) test -race -count=1 -p 1 ./...
	$(GO) test -count=1 -p 1 -run 'Alloc' ./breaker/ ./interceptor/ ./internal/budget/ ./internal/cow/ ./internal/latency/ ./internal/pacing/ ./mesh/ ./overload/
	cd cmd && $(GO) vet ./... && $(GO) test -race -count=1 -p 1 ./...
	cd conformance && $(GO) vet ./... && $(GO) test -race -count=1 ./...
	cd redisfleet && $(GO) vet ./... && $(GO) test -race -count=1 ./...
	cd bench && $(GO) vet . && $(GO) test -count=1 .

# The timing tests (TestTiming...) measure the storm lab's scenarios over
# real gRPC in wall time: calls ok, arrivals per window, recovery. They
# hold on a busy machine only with the cores to themselves, one package at
# a time and without the race detector; make test skips them, and make e2e
# (which CI runs) runs them first.
.PHONY: timing
timing: ## Run the timing tests: the storm lab's scenarios over real gRPC in wall time (about 5 minutes)
	HERDGUARD_TIMING=1 $(GO) test -count=1 -p 1 -run 'Timing' ./interceptor/
	cd cmd && HERDGUARD_TIMING=1 $(GO) test -count=1 -p 1 -run 'Timing' ./stormlab/ ./fleet-lab/

.PHONY: build
build: ## Build the demo server, the demo client and trace-demo into ./bin
	cd cmd && $(GO) build -o $(BIN)/demo-server ./demo-server
	cd cmd && $(GO) build -o $(BIN)/demo-client ./demo-client
	cd cmd && $(GO) build -o $(BIN)/trace-demo ./trace-demo

# Jaeger v2, built from its Go module pinned in tools/jaeger (a module of its
# own, so the library's go.mod stays clean): about 5 minutes the first time.
$(BIN)/jaeger: tools/jaeger/go.mod tools/jaeger/go.sum
	cd tools/jaeger && $(GO) build -o $(BIN)/jaeger github.com/jaegertracing/jaeger/cmd/jaeger

.PHONY: jaeger
jaeger: $(BIN)/jaeger build ## Build Jaeger v2 and run it on 127.0.0.1 (free ports, printed) until Ctrl-C; JAEGER_UI=dir serves a jaeger-ui build
	$(BIN)/trace-demo -jaeger-only -bin $(BIN) -config tools/jaeger/config.yaml $(if $(JAEGER_UI),-ui "$(JAEGER_UI)")

.PHONY: trace-demo
trace-demo: $(BIN)/jaeger build ## Jaeger, a traced demo server and client on 127.0.0.1: trace ids of retried calls with Jaeger links, bin/trace.svg
	$(BIN)/trace-demo -bin $(BIN) -config tools/jaeger/config.yaml -trace-svg $(BIN)/trace.svg $(if $(JAEGER_UI),-ui "$(JAEGER_UI)") $(TRACE_DEMO_ARGS)

.PHONY: trace-mesh
trace-mesh: $(BIN)/jaeger build ## Jaeger and the mesh lab's chain (user -> gateway -> service -> leaf), every tier traced: user calls retried below the user, bin/mesh-trace.svg
	$(BIN)/trace-demo -mesh -bin $(BIN) -config tools/jaeger/config.yaml -trace-svg $(BIN)/mesh-trace.svg $(if $(JAEGER_UI),-ui "$(JAEGER_UI)") $(TRACE_DEMO_ARGS)

.PHONY: e2e
e2e: $(BIN)/jaeger build ## End-to-end: the timing tests (make timing), then the trace demo against a real Jaeger, every trace read back through its HTTP API
	$(MAKE) timing
	cd cmd && HERDGUARD_E2E=1 HERDGUARD_BIN=$(BIN) $(GO) test -count=1 -v -run E2E ./trace-demo/

# The demo's brownout: steady load through a capacity cut of the sticky
# server, at scale 2 (about a minute), offered by one client and by 40, each
# with its own interceptor: at scale 4 its 25 ms windows are within the
# noise of a 2-core machine, and every client overshoots them.
DEMO_STEADY_ARGS ?= -scenario steady-cut -scale 2 -clients 1,40 -strategy 'no retries,herdguard defaults,exponential + full jitter' -goodput-svg $(BIN)/goodput.svg

# The demo's partial failures, in short: each loop at p = 0.67 and a dead
# server, at scale 2 (about a minute).
DEMO_PARTIAL_ARGS ?= -compare -scenario partial-short -scale 2 -partial-svg $(BIN)/partial.svg

# The demo's mesh, in short: the chain user -> gateway -> service -> leaf
# through the leaf's outage, at scale 2, one run (about 30 s): retries at
# every layer multiply, the server half does not.
DEMO_MESH_ARGS ?= -scenario steady-outage -scale 2 -mesh-svg $(BIN)/mesh.svg \
  -mesh-strategies 'go-grpc-middleware at every layer,herdguard at every layer,herdguard + server half,herdguard at the last hop only'

.PHONY: demo
demo: build ggm-tier ## Start the demo server on 127.0.0.1, run the client against it, stop the server; then a short mesh lab (bin/mesh.svg)
	@addr_file=$$(mktemp); rm -f "$$addr_file"; \
	$(BIN)/demo-server -addr 127.0.0.1:0 -addr-file "$$addr_file" & server=$$!; \
	trap 'kill $$server 2>/dev/null || true; wait $$server 2>/dev/null || true; rm -f "$$addr_file"' EXIT; \
	for i in $$(seq 100); do [ -s "$$addr_file" ] && break; sleep 0.05; done; \
	[ -s "$$addr_file" ] || { echo "demo-server did not start" >&2; exit 1; }; \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" $(DEMO_ARGS); \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" $(DEMO_STEADY_ARGS); \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" $(DEMO_PARTIAL_ARGS); \
	echo; echo "One retried call of herdguard's defaults, as its spans tell it:"; \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" $(TRACE_ARGS) 2>/dev/null | sed -n '/^span tree/,/^$$/p'; \
	echo; echo "Retries at one layer in a mesh: three hops, every tier a process of its own; the server half must keep the leaf to one retrying layer without costing calls:"; \
	$(BIN)/demo-client -mesh -server-bin $(BIN)/demo-server -ggm-tier-bin $(BIN)/ggm-tier $(DEMO_MESH_ARGS)

# go-grpc-middleware's tier for the mesh lab, in module cmd (the library's
# own module does not depend on go-grpc-middleware).
.PHONY: ggm-tier
ggm-tier: ## Build cmd/ggm-tier, the mesh lab's go-grpc-middleware tier, into ./bin
	cd cmd && $(GO) build -o $(BIN)/ggm-tier ./ggm-tier

# make mesh MESH_ARGS='-runs 1 -scale 2' for a quick look.
MESH_ARGS ?= -runs 3 -scale 1

.PHONY: mesh
mesh: build ggm-tier ## The mesh lab at full scale, medians of 3: depth 3 at a healthy leaf, through its brownouts and at a 67 % failing leaf, six strategies (about 13 minutes); writes bin/mesh.svg
	$(BIN)/demo-client -mesh -server-bin $(BIN)/demo-server -ggm-tier-bin $(BIN)/ggm-tier -mesh-svg $(BIN)/mesh.svg $(MESH_ARGS)

# make storm STORM_ARGS='-runs 1 -scale 4' STORM_PEER_ENV='HERDGUARD_STORM_RUNS=1 HERDGUARD_STORM_SCALE=4' for a quick look.
STORM_ARGS ?= -runs 3
STORM_PEER_ENV ?= HERDGUARD_STORM_RUNS=3 HERDGUARD_STORM_SCALE=1
# The fleets: the herds and brownouts offered by this many clients, each
# with a connection and an interceptor of its own.
STORM_CLIENTS ?= 1,10,40,100

.PHONY: storm
storm: build ## The storm lab at full scale, medians of 3: herds, brownouts (one client, then fleets), a server that dies, partial failures, and the peers beside them (about 5 hours); writes bin/goodput.svg, bin/storm-herds.svg, bin/fleet.svg and bin/partial.svg
	@addr_file=$$(mktemp); rm -f "$$addr_file"; \
	$(BIN)/demo-server -addr 127.0.0.1:0 -addr-file "$$addr_file" & server=$$!; \
	trap 'kill $$server 2>/dev/null || true; wait $$server 2>/dev/null || true; rm -f "$$addr_file"' EXIT; \
	for i in $$(seq 100); do [ -s "$$addr_file" ] && break; sleep 0.05; done; \
	[ -s "$$addr_file" ] || { echo "demo-server did not start" >&2; exit 1; }; \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" -compare -scenario herds,herds-deadline,steady \
	  -svg $(BIN)/storm-herds.svg -goodput-svg $(BIN)/goodput.svg $(STORM_ARGS); \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" -scenario herds,herds-deadline,steady -clients $(STORM_CLIENTS) \
	  -strategy 'no retries,herdguard defaults' -fleet-svg $(BIN)/fleet.svg $(STORM_ARGS); \
	$(BIN)/demo-client -addr "$$(cat "$$addr_file")" -compare -scenario dead $(STORM_ARGS)
	cd bench && HERDGUARD_STORM=1 HERDGUARD_STORM_SCENARIOS=herds-deadline,steady HERDGUARD_STORM_CLIENTS=$(STORM_CLIENTS) $(STORM_PEER_ENV) \
	  $(GO) test -run TestStormTable -count=1 -v -timeout 6h . | grep -v '^[=-]\{3\}' | sed '/^ok\|^PASS/d'
	cd bench && HERDGUARD_STORM=1 HERDGUARD_STORM_SCENARIOS=partial HERDGUARD_PARTIAL_SVG=$(BIN)/partial.svg $(STORM_PEER_ENV) \
	  $(GO) test -run TestStormTable -count=1 -v -timeout 3h . | grep -v '^[=-]\{3\}' | sed '/^ok\|^PASS/d'

.PHONY: fleet-demo
fleet-demo: ## The fleet scenario: 8 replica processes, own breakers or one shared through a real Redis (needs redis-server)
	cd cmd && $(GO) build -o $(BIN)/fleet-lab ./fleet-lab
	$(BIN)/fleet-lab $(FLEET_ARGS)

.PHONY: bench
bench: $(BIN)/benchstat ## Run the benchmarks (5 times each), the storm table and the hedging table; write .bench/ and docs/benchmarks.md
	@mkdir -p $(BENCH_OUT)
	$(GO) test -p 1 -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) ./... | tee $(BENCH_OUT)/core.txt
	cd bench && $(GO) test -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) . | tee ../$(BENCH_OUT)/peers.txt
	cd redisfleet && $(GO) test -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) . | tee ../$(BENCH_OUT)/fleet.txt
	$(BIN)/benchstat $(BENCH_OUT)/core.txt > $(BENCH_OUT)/core-summary.txt
	$(BIN)/benchstat -col /peer $(BENCH_OUT)/peers.txt > $(BENCH_OUT)/peers-summary.txt
	$(BIN)/benchstat $(BENCH_OUT)/fleet.txt > $(BENCH_OUT)/fleet-summary.txt
	cd cmd && $(GO) run ./fleet-lab 2>/dev/null > ../$(BENCH_OUT)/fleet-lab.txt
	cd bench && HERDGUARD_STORM=1 $(GO) test -run TestStormTable -count=1 -v . | grep -v '^[=-]\{3\}' | sed '/^ok\|^PASS/d' > ../$(BENCH_OUT)/storm.txt
	cd bench && HERDGUARD_STORM=1 $(GO) test -run TestHedgeTable -count=1 -v . | grep -v '^[=-]\{3\}' | sed '/^ok\|^PASS/d' > ../$(BENCH_OUT)/hedge.txt
	@{ echo "# Benchmarks"; echo; \
	  echo "Written by \`make bench\` on $$(date -u +%Y-%m-%d); reproduce with \`make bench\` (raw results in \`.bench/\`)."; echo; \
	  echo "Machine: $$(nproc) cores, $$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $$($(GO) version | cut -d' ' -f3-)."; echo; \
	  echo "Medians of $(BENCH_COUNT) runs (benchstat). A whole call over bufconn varies 15-40 % between runs here: compare"; \
	  echo "its allocations; compare time where the interceptor runs alone (an invoker that does nothing)."; echo; \
	  echo "## Side by side with the peers (module bench/)"; echo; echo '```'; cat $(BENCH_OUT)/peers-summary.txt; echo '```'; echo; \
	  echo "## The storm table: the herds and the brownouts through the peers, at scale 1/2, one run each"; echo; echo '```'; cat $(BENCH_OUT)/storm.txt; echo '```'; echo; \
	  echo "## Hedging: slow attempts (1 in 100 takes 1 s)"; echo; echo '```'; cat $(BENCH_OUT)/hedge.txt; echo '```'; echo; \
	  echo "## One breaker for the fleet (module redisfleet, a real Redis)"; echo; echo '```'; cat $(BENCH_OUT)/fleet-summary.txt; echo; cat $(BENCH_OUT)/fleet-lab.txt; echo '```'; echo; \
	  echo "## herdguard's own benchmarks"; echo; echo '```'; cat $(BENCH_OUT)/core-summary.txt; echo '```'; \
	} > docs/benchmarks.md
	@echo "wrote docs/benchmarks.md"

.PHONY: exports
exports: ## Count the exported identifiers of the library's packages (the README's packages section)
	$(GO) run ./tools/exports . ./policy ./breaker ./interceptor ./overload ./mesh ./telemetry ./redisfleet

.PHONY: lint
lint: $(BIN)/buf ## go vet (every module), gofmt, buf lint, buf format, and a check that generated code is fresh
	$(GO) vet ./...
	for m in cmd bench conformance redisfleet; do (cd $$m && $(GO) vet ./...); done
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	if [ -n "$$out" ]; then echo "gofmt wants to change:"; echo "$$out"; exit 1; fi
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(MAKE) checkgenerate

.PHONY: proto
proto: $(BIN)/buf $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc ## Regenerate the Go code from proto/ with local plugins
	$(BIN)/buf generate

.PHONY: checkgenerate
checkgenerate: proto ## Fail when the committed generated code is stale
	@git diff --exit-code -- proto || { echo "generated code is stale: run make proto and commit" >&2; exit 1; }

$(BIN)/buf:
	GOBIN=$(BIN) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)

$(BIN)/protoc-gen-go:
	GOBIN=$(BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

$(BIN)/protoc-gen-go-grpc:
	GOBIN=$(BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

$(BIN)/benchstat:
	GOBIN=$(BIN) $(GO) install golang.org/x/perf/cmd/benchstat@$(BENCHSTAT_VERSION)

.PHONY: clean
clean: ## Remove ./bin and benchmark output
	rm -rf $(BIN) $(BENCH_OUT)
