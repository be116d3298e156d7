# csibroker — build, test, benchmark, run.
#
#   make run      build what is missing and run the local demo: a real control plane,
#                 two sample drivers behind proxies, the broker, claims, a policy denial
#   make test     everything CI runs: format, vet, the control plane, sidecar and
#                 Jaeger builds (cached), every test with the race detector, then
#                 every fuzz target for FUZZ_TIME (make fuzz)
#   make bench    CSI path benchmarks and policy benchmarks (see BENCHMARKS.md)
#   make bench-k8s  csibroker against external-provisioner/attacher on a real control plane

SHELL := /bin/bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X main.version=$(VERSION)
BIN := bin/csibroker
PKGS := ./...
TEST_TIMEOUT ?= 40m
BENCH_TIME ?= 2s
BENCH_COUNT ?= 3
# h2spec (HTTP/2 conformance, test/h2spec), pinned; `make h2spec` installs it
# here, and the tests find it through the H2SPEC environment variable.
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(CURDIR)/bin/tools/staticcheck-$(STATICCHECK_VERSION)
H2SPEC_VERSION := v2.2.1+incompatible
H2SPEC := $(CURDIR)/bin/tools/h2spec-$(H2SPEC_VERSION)
export H2SPEC

.PHONY: all build test test-unit fuzz fmt-check vet staticcheck lint bench bench-k8s rss-floor proto run demo control-plane sidecars snapshot-controller jaeger h2spec clean docker

all: build

## bin/csibroker (every subcommand) and bin/csibroker-proxy (the proxy alone,
## for the process beside each driver socket).
build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/ ./cmd/csibroker ./cmd/csibroker-proxy

## The control plane (etcd + kube-apiserver + controller-manager + scheduler)
## is built once per machine into a cache keyed by version; later runs reuse it.
control-plane:
	hack/control-plane.sh build

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet $(PKGS)

## staticcheck, pinned, installed once into bin/tools (git-ignored).
staticcheck: $(STATICCHECK)
	$(STATICCHECK) $(PKGS)

$(STATICCHECK):
	@mkdir -p $(@D)/.staticcheck
	GOFLAGS= GOBIN=$(@D)/.staticcheck $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(@D)/.staticcheck/staticcheck $@

lint: fmt-check vet staticcheck

## The sidecars (for the side-by-side harness's smoke test), Jaeger (for
## the tracing tests) and h2spec are built here too, before the tests and
## outside their time limits, cached like the control plane.
test: lint control-plane sidecars jaeger h2spec
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(PKGS)
	$(MAKE) --no-print-directory fuzz

## Every fuzz target of a parser of input the broker does not control, for
## FUZZ_TIME each (plain `go test` runs only their seed corpora). A count of
## inputs, not a duration: with a duration, go test can fail a clean run
## with "context deadline exceeded" when time runs out mid-input.
FUZZ_TIME ?= 20000x
FUZZ_TARGETS := ./broker/:FuzzParseRegistryConfig ./policy/:FuzzCompileGrant ./policy/:FuzzDecide \
	./k8sbridge/secrets/:FuzzRef ./k8sbridge/csiparams/:FuzzCreateParameters ./k8sbridge/csiparams/:FuzzCheckCreatedVolume \
	./k8sbridge/intent/:FuzzDecodeIntents \
	./k8sbridge/csiparams/:FuzzCheckListVolumes \
	./k8sbridge/csiparams/:FuzzCheckPublished ./k8sbridge/csiparams/:FuzzCheckCapacity
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		echo "fuzz $$name in $$pkg for $(FUZZ_TIME)"; \
		$(GO) test -run='^$$' -fuzz="^$$name\$$" -fuzztime=$(FUZZ_TIME) $$pkg; \
	done

## Fast tests: no race detector, and the packages that need the control plane
## fail with a message saying how to build it.
test-unit:
	$(GO) test -count=1 $(PKGS)

## Benchmarks compare the broker chain with the driver socket side by side in
## one run; BENCHMARKS.md records the figures and this command.
bench:
	$(GO) test -run='^$$' -bench=. -benchtime=$(BENCH_TIME) -count=$(BENCH_COUNT) ./test/bench/
	$(GO) test -run='^$$' -bench=Decide -benchmem ./policy/

## csibroker side by side with external-provisioner and external-attacher on a
## real local control plane (builds the sidecars once, cached); figures in
## BENCHMARKS.md. Extra flags: make bench-k8s BENCH_K8S_FLAGS='-n 300,1000'
BENCH_K8S_FLAGS ?=
bench-k8s:
	$(GO) run ./test/benchk8s $(BENCH_K8S_FLAGS)

## The resident memory of the proxy's and broker's libraries alone, next to an
## idle csibroker-proxy (BENCHMARKS.md, "The floor under the targets").
rss-floor:
	hack/rss-floor.sh

sidecars:
	hack/sidecars.sh build

## The cluster's snapshot-controller alone (the demo's snapshot step).
snapshot-controller:
	hack/sidecars.sh build snapshot-controller

## Jaeger all-in-one (OTLP in, query API out), for test/tracing and the demo:
## about 6 minutes the first time on 2 cores, cached after.
jaeger:
	hack/jaeger.sh build

## h2spec, installed once into bin/tools/ (git-ignored) under a name with its
## version, so a new pin installs anew. It has no go.mod: its dependencies
## resolve to their newest versions when it is installed.
h2spec: $(H2SPEC)

$(H2SPEC):
	@mkdir -p $(@D)/.h2spec
	GOFLAGS= GOBIN=$(@D)/.h2spec $(GO) install github.com/summerwind/h2spec/cmd/h2spec@$(H2SPEC_VERSION)
	mv $(@D)/.h2spec/h2spec $@
	rmdir $(@D)/.h2spec

## Regenerate proto/ (needs protoc: apt-get install protobuf-compiler).
proto:
	@command -v protoc >/dev/null || { echo "installing protoc"; apt-get update -qq && apt-get install -y -qq protobuf-compiler; }
	GOFLAGS= $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
	GOFLAGS= $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.0
	PATH="$$PATH:$$($(GO) env GOPATH)/bin" protoc -I proto \
		--go_out=. --go_opt=module=github.com/csibroker/csibroker \
		--go-grpc_out=. --go-grpc_opt=module=github.com/csibroker/csibroker --go-grpc_opt=require_unimplemented_servers=false \
		$$(find proto -name '*.proto')
	# Our servers implement their whole services: drop the generated
	# Unimplemented*/Unsafe* stubs.
	$(GO) run ./hack/stripstubs $$(find proto -name '*_grpc.pb.go')

## The demo sends its traces to Jaeger when it is built (make jaeger), and
## prints them as a tree either way.
run: control-plane snapshot-controller build
	$(BIN) demo

demo: run

docker:
	docker build --build-arg VERSION=$(VERSION) -t csibroker:$(VERSION) .

clean:
	rm -rf bin
