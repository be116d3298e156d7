#!/usr/bin/env bash
# jaeger.sh builds Jaeger all-in-one, the tracing backend that the tracing
# tests and the local demo export spans to, from the Go module proxy into a
# cache directory outside the repository, keyed by version, so every clone on
# the machine reuses it (the way hack/sidecars.sh builds the sidecars). The
# module carries no web UI: the binary serves OTLP in and the query API out.
# See /work/shared/notes/peers.md.
#
# Usage:
#   hack/jaeger.sh [build]   build it if it is missing (default)
#   hack/jaeger.sh path      print the path of the binary
#
# Environment:
#   CSIBROKER_CACHE   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/csibroker)
#
# internal/testenv looks for the binary at the same path (or in
# $CSIBROKER_JAEGER); keep the two in step when bumping the version.
set -euo pipefail

JAEGER_MODULE=github.com/jaegertracing/jaeger
JAEGER_VERSION=v1.76.0
JAEGER_PKG="${JAEGER_MODULE}/cmd/jaeger"

CACHE_ROOT="${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}"
# Absolute: the build runs go in another directory.
CACHE_ROOT=$(realpath -m -- "$CACHE_ROOT")
J_DIR="${CACHE_ROOT}/jaeger/jaeger-${JAEGER_VERSION}"
J_BIN="${J_DIR}/jaeger"

log() { printf 'jaeger: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# ok: the binary exists and answers its version subcommand.
ok() {
	[[ -x "$J_BIN" ]] && "$J_BIN" version >/dev/null 2>&1
}

cmd_build() {
	if ok; then
		log "${JAEGER_VERSION}: cached in ${J_DIR}"
		return
	fi
	command -v go >/dev/null || die "go is not on PATH"
	mkdir -p "$J_DIR"

	# One builder at a time: a second invocation waits, then finds it built.
	exec 9>"${J_DIR}/.lock"
	if ! flock -n 9; then
		log "another build holds ${J_DIR}/.lock; waiting for it"
		flock 9
	fi
	if ok; then
		log "${JAEGER_VERSION}: built by the other invocation, in ${J_DIR}"
		return
	fi
	trap 'rm -f "${J_DIR}"/.jaeger.tmp.*' EXIT

	local start=$SECONDS src="${J_DIR}/src" logf="${J_DIR}/build.log"
	mkdir -p "$src"
	: >"$logf"
	log "${JAEGER_VERSION}: building from ${JAEGER_MODULE} (go output in ${logf}; about 6 minutes cold on 2 cores)"
	cat >"${src}/go.mod" <<EOF
module csibroker.local/jaeger

go 1.26
EOF
	gorun "$logf" "$src" go get -tool "${JAEGER_PKG}@${JAEGER_VERSION}"
	log "${JAEGER_VERSION}: modules resolved in $(fmt_secs $((SECONDS - start)))"
	local t=$SECONDS
	gorun "$logf" "$src" go build -trimpath \
		-ldflags "-s -w -X ${JAEGER_MODULE}/internal/version.latestVersion=${JAEGER_VERSION}" \
		-o "${J_DIR}/.jaeger.tmp.$$" "$JAEGER_PKG"
	mv -f "${J_DIR}/.jaeger.tmp.$$" "$J_BIN"
	ok || die "built jaeger does not answer 'jaeger version'"
	log "${JAEGER_VERSION}: compiled in $(fmt_secs $((SECONDS - t))), ready at ${J_BIN} ($(fmt_secs $((SECONDS - start))) in all)"
}

case "${1:-build}" in
build) cmd_build ;;
path) printf '%s\n' "$J_BIN" ;;
-h | --help | help) sed -n '2,17s/^# \{0,1\}//p' "$0" ;;
*) die "unknown subcommand '$1' (want: build, path)" ;;
esac
