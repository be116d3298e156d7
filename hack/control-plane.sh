#!/usr/bin/env bash
# control-plane.sh builds the pinned Kubernetes control plane used by tests and
# the local demo (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
# from the Go module proxy, into a cache directory outside the repository so that
# every clone on the machine reuses it. See /work/shared/notes/control-plane.md.
#
# Usage:
#   hack/control-plane.sh [build]   build whatever is missing (default)
#   hack/control-plane.sh bindir    print the directory holding the binaries
#
# Environment:
#   CSIBROKER_CACHE   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/csibroker)
#
# internal/testenv looks for the binaries in the same directory (or in
# $CSIBROKER_CONTROL_PLANE_BIN); keep the two in step when bumping versions.
set -euo pipefail

K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.8
# Staging modules (k8s.io/api, ...) are tagged v0.X.Y for Kubernetes v1.X.Y.
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
K8S_COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)

CACHE_ROOT="${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}"
# Absolute: the builds run go in other directories.
CACHE_ROOT=$(realpath -m -- "$CACHE_ROOT")
CP_DIR="${CACHE_ROOT}/control-plane/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}"
BIN_DIR="${CP_DIR}/bin"
SRC_DIR="${CP_DIR}/src"
BUILD_LOG="${CP_DIR}/build.log"

log() { printf 'control-plane: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# ok NAME: the binary exists and answers --version.
ok() {
	local b="${BIN_DIR}/$1"
	[[ -x "$b" ]] && "$b" --version >/dev/null 2>&1
}

all_ok() {
	local name
	for name in etcd "${K8S_COMPONENTS[@]}"; do
		ok "$name" || return 1
	done
}

build_etcd() {
	if ok etcd; then
		log "etcd ${ETCD_VERSION}: cached"
		return
	fi
	local start=$SECONDS dir="${SRC_DIR}/etcd"
	log "etcd ${ETCD_VERSION}: building (under a minute cold)"
	mkdir -p "$dir"
	cat >"${dir}/go.mod" <<EOF
module csibroker.local/control-plane/etcd

go 1.26
EOF
	cat >"${dir}/main.go" <<'EOF'
// Command etcd is etcd's own main, built from the module proxy.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
	gorun "$BUILD_LOG" "$dir" go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
	gorun "$BUILD_LOG" "$dir" go mod tidy
	gorun "$BUILD_LOG" "$dir" go build -trimpath -ldflags "-s -w" -o "${BIN_DIR}/.etcd.tmp.$$" .
	mv -f "${BIN_DIR}/.etcd.tmp.$$" "${BIN_DIR}/etcd"
	ok etcd || die "built etcd does not answer --version"
	log "etcd ${ETCD_VERSION}: built in $(fmt_secs $((SECONDS - start)))"
}

# staging_replaces prints one "replace" line per staging module that
# k8s.io/kubernetes's own go.mod points at ./staging/src/k8s.io/<name>, so the
# list follows the pinned version instead of being copied by hand.
staging_replaces() {
	local gomod
	gomod=$(cd "${SRC_DIR}/kubernetes" && go_env go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" 2>>"$BUILD_LOG" |
		sed -n 's/^[[:space:]]*"GoMod":[[:space:]]*"\(.*\)",\{0,1\}$/\1/p')
	[[ -n "$gomod" && -f "$gomod" ]] || die "cannot find go.mod of k8s.io/kubernetes@${K8S_VERSION} in the module cache"
	sed -n 's#^[[:space:]]*\(replace[[:space:]]\{1,\}\)\{0,1\}\(k8s\.io/[A-Za-z0-9._-]\{1,\}\)[[:space:]]\{1,\}=>[[:space:]]\{1,\}\./staging/src/\2[[:space:]]*$#replace \2 => \2 '"${STAGING_VERSION}"'#p' "$gomod"
}

build_k8s() {
	local missing=() name
	for name in "${K8S_COMPONENTS[@]}"; do
		if ok "$name"; then
			log "${name} ${K8S_VERSION}: cached"
		else
			missing+=("$name")
		fi
	done
	((${#missing[@]} > 0)) || return 0

	local dir="${SRC_DIR}/kubernetes" start=$SECONDS
	mkdir -p "$dir"
	if [[ ! -f "${dir}/.resolved" ]]; then
		log "kubernetes ${K8S_VERSION}: resolving modules (downloads the sources the first time)"
		cat >"${dir}/go.mod" <<EOF
module csibroker.local/control-plane/kubernetes

go 1.26

require k8s.io/kubernetes ${K8S_VERSION}
EOF
		local replaces n
		replaces=$(staging_replaces)
		n=$(grep -c '^replace ' <<<"$replaces" || true)
		((n > 0)) || die "no staging replace lines found in k8s.io/kubernetes@${K8S_VERSION}'s go.mod"
		log "kubernetes ${K8S_VERSION}: ${n} staging modules replaced with ${STAGING_VERSION}"
		printf '\n%s\n' "$replaces" >>"${dir}/go.mod"
		local pkgs=()
		for name in "${K8S_COMPONENTS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/${name}@${K8S_VERSION}"); done
		gorun "$BUILD_LOG" "$dir" go get "${pkgs[@]}"
		touch "${dir}/.resolved"
		log "kubernetes ${K8S_VERSION}: modules resolved in $(fmt_secs $((SECONDS - start)))"
	fi

	# Stamp the version the way the Kubernetes release build does, so that
	# --version and the apiserver's /version report the real release.
	local minor="${K8S_VERSION#v1.}"
	minor="${minor%%.*}"
	local ldflags="-s -w"
	ldflags+=" -X k8s.io/component-base/version.gitVersion=${K8S_VERSION}"
	ldflags+=" -X k8s.io/component-base/version.gitMajor=1"
	ldflags+=" -X k8s.io/component-base/version.gitMinor=${minor}"
	ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
	ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION}"
	ldflags+=" -X k8s.io/client-go/pkg/version.gitMajor=1"
	ldflags+=" -X k8s.io/client-go/pkg/version.gitMinor=${minor}"

	local first=1
	for name in "${missing[@]}"; do
		local t=$SECONDS hint="reuses the packages built before it"
		((first)) && hint="the first takes 3-6 min cold on 2 cores"
		first=0
		log "${name} ${K8S_VERSION}: building (${hint})"
		gorun "$BUILD_LOG" "$dir" go build -trimpath -ldflags "$ldflags" -o "${BIN_DIR}/.${name}.tmp.$$" "k8s.io/kubernetes/cmd/${name}"
		mv -f "${BIN_DIR}/.${name}.tmp.$$" "${BIN_DIR}/${name}"
		ok "$name" || die "built ${name} does not answer --version"
		log "${name} ${K8S_VERSION}: built in $(fmt_secs $((SECONDS - t)))"
	done
}

cmd_build() {
	if all_ok; then
		log "all binaries cached in ${BIN_DIR}"
		return
	fi
	command -v go >/dev/null || die "go is not on PATH"
	mkdir -p "$BIN_DIR" "$SRC_DIR"

	# One builder at a time: a second invocation waits, then finds the work done.
	exec 9>"${CP_DIR}/.lock"
	if ! flock -n 9; then
		log "another build holds ${CP_DIR}/.lock; waiting for it"
		flock 9
	fi
	if all_ok; then
		log "all binaries in ${BIN_DIR}, built by the other invocation"
		return
	fi
	trap 'rm -f "${BIN_DIR}"/.*.tmp.$$' EXIT

	local start=$SECONDS
	log "building into ${BIN_DIR} (go output in ${BUILD_LOG})"
	: >"$BUILD_LOG"
	build_etcd
	build_k8s
	all_ok || die "some binaries are still missing in ${BIN_DIR}"
	log "all binaries ready in ${BIN_DIR} ($(fmt_secs $((SECONDS - start))))"
}

case "${1:-build}" in
build) cmd_build ;;
bindir) printf '%s\n' "$BIN_DIR" ;;
-h | --help | help) sed -n '2,15s/^# \{0,1\}//p' "$0" ;;
*) die "unknown subcommand '$1' (want: build, bindir)" ;;
esac
