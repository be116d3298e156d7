#!/usr/bin/env bash
# sidecars.sh builds the real Kubernetes CSI sidecars that csibroker is
# benchmarked against (external-provisioner, external-attacher, and
# external-snapshotter's csi-snapshotter and snapshot-controller) from the Go
# module proxy, into a cache directory outside the repository, keyed by name and
# version, so every clone on the machine reuses them. See
# /work/shared/notes/peers.md for why `go install` does not work: their go.mod
# files carry `replace` lines, which are copied here into a throwaway module
# (local-path ones left out: external-snapshotter's `client/v8 => ./client` is
# not in its module zip, and `go get` resolves client/v8 from the proxy).
#
# Cold on 2 cores: csi-provisioner and csi-attacher a few minutes each,
# csi-snapshotter about 4.5 minutes (8 with other builds running), then
# snapshot-controller in seconds (it shares the Go build cache). Once per
# machine or CI cache.
#
# Usage:
#   hack/sidecars.sh [build [NAME...]]
#                              build whatever is missing (default: every sidecar)
#   hack/sidecars.sh dir NAME  print the directory holding NAME's binary
#                              (NAME: csi-provisioner, csi-attacher,
#                              csi-snapshotter or snapshot-controller)
#   hack/sidecars.sh list      print "NAME PATH" for every sidecar binary
#
# Environment:
#   CSIBROKER_CACHE   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/csibroker)
#
# test/benchk8s looks for the binaries in the same directories; keep the two in
# step when bumping versions.
set -euo pipefail

# name|module|version|package (the command inside the module)
SIDECARS=(
	"csi-provisioner|github.com/kubernetes-csi/external-provisioner/v6|v6.3.0|cmd/csi-provisioner"
	"csi-attacher|github.com/kubernetes-csi/external-attacher/v4|v4.13.0|cmd/csi-attacher"
	"csi-snapshotter|github.com/kubernetes-csi/external-snapshotter/v8|v8.7.0|cmd/csi-snapshotter"
	"snapshot-controller|github.com/kubernetes-csi/external-snapshotter/v8|v8.7.0|cmd/snapshot-controller"
)

CACHE_ROOT="${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}"
# Absolute: the builds run go in other directories.
CACHE_ROOT=$(realpath -m -- "$CACHE_ROOT")
SC_ROOT="${CACHE_ROOT}/sidecars"

log() { printf 'sidecars: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# fields ENTRY sets name, module, version, pkg and dir for one sidecar.
fields() {
	IFS='|' read -r name module version pkg <<<"$1"
	dir="${SC_ROOT}/${name}-${version}"
}

# ok DIR NAME: the binary exists and prints its version.
ok() {
	local b="$1/$2"
	[[ -x "$b" ]] && "$b" --version >/dev/null 2>&1
}

# module_replaces SRC MODULE VERSION LOG prints the replace directives of
# MODULE@VERSION's own go.mod (single-line and block form), one per line as
# "replace A => B V", leaving out local-path replacements, which cannot apply
# outside the module's own tree.
module_replaces() {
	local src=$1 mod=$2 ver=$3 logf=$4 gomod
	gomod=$(cd "$src" && go_env go mod download -json "${mod}@${ver}" 2>>"$logf" |
		sed -n 's/^[[:space:]]*"GoMod":[[:space:]]*"\(.*\)",\{0,1\}$/\1/p')
	[[ -n "$gomod" && -f "$gomod" ]] || die "cannot find go.mod of ${mod}@${ver} in the module cache"
	awk '
		function emit(s) {
			sub(/\/\/.*/, "", s)
			gsub(/^[ \t]+|[ \t]+$/, "", s)
			if (s == "") return
			split(s, p, /[ \t]*=>[ \t]*/)
			if (p[2] ~ /^(\.|\/)/) return
			print "replace " s
		}
		inblock && /^[ \t]*\)/ { inblock = 0; next }
		inblock { emit($0); next }
		/^replace[ \t]*\(/ { inblock = 1; next }
		/^replace[ \t]/ { sub(/^replace[ \t]+/, ""); emit($0) }
	' "$gomod"
}

build_one() {
	local name module version pkg dir
	fields "$1"
	if ok "$dir" "$name"; then
		log "${name} ${version}: cached in ${dir}"
		return
	fi
	local start=$SECONDS src="${dir}/src" logf="${dir}/build.log"
	mkdir -p "$src"
	: >"$logf"
	log "${name} ${version}: building from ${module} (go output in ${logf}; a few minutes cold on 2 cores)"
	cat >"${src}/go.mod" <<EOF
module csibroker.local/sidecars/${name}

go 1.26
EOF
	local replaces n
	replaces=$(module_replaces "$src" "$module" "$version" "$logf")
	n=$(grep -c '^replace ' <<<"$replaces" || true)
	if ((n > 0)); then
		printf '\n%s\n' "$replaces" >>"${src}/go.mod"
	fi
	log "${name} ${version}: ${n} replace lines copied from ${module}@${version}'s go.mod"
	gorun "$logf" "$src" go get "${module}/${pkg}@${version}"
	log "${name} ${version}: modules resolved in $(fmt_secs $((SECONDS - start)))"
	local t=$SECONDS
	gorun "$logf" "$src" go build -trimpath -ldflags "-s -w -X main.version=${version}" \
		-o "${dir}/.${name}.tmp.$$" "${module}/${pkg}"
	mv -f "${dir}/.${name}.tmp.$$" "${dir}/${name}"
	ok "$dir" "$name" || die "built ${name} does not answer --version"
	log "${name} ${version}: compiled in $(fmt_secs $((SECONDS - t))), ready in ${dir} ($(fmt_secs $((SECONDS - start))) in all)"
}

# cmd_build [NAME...] builds the named sidecars (default: every one) that
# are missing.
cmd_build() {
	local want=("$@") e name module version pkg dir
	local entries=()
	for e in "${SIDECARS[@]}"; do
		fields "$e"
		if ((${#want[@]} == 0)) || [[ " ${want[*]} " == *" ${name} "* ]]; then
			entries+=("$e")
		fi
	done
	((${#entries[@]} > 0)) || die "unknown sidecar in '${want[*]}'"
	if entries_ok "${entries[@]}"; then
		log "${want[*]:-all sidecars}: cached under ${SC_ROOT}"
		return
	fi
	command -v go >/dev/null || die "go is not on PATH"
	mkdir -p "$SC_ROOT"

	# One builder at a time: a second invocation waits, then finds the work done.
	exec 9>"${SC_ROOT}/.lock"
	if ! flock -n 9; then
		log "another build holds ${SC_ROOT}/.lock; waiting for it"
		flock 9
	fi
	if entries_ok "${entries[@]}"; then
		log "${want[*]:-all sidecars}: under ${SC_ROOT}, built by the other invocation"
		return
	fi
	trap 'rm -f "${SC_ROOT}"/*/.*.tmp.$$' EXIT

	local start=$SECONDS
	for e in "${entries[@]}"; do
		build_one "$e"
	done
	entries_ok "${entries[@]}" || die "some sidecars are still missing under ${SC_ROOT}"
	log "${want[*]:-all sidecars}: ready under ${SC_ROOT} ($(fmt_secs $((SECONDS - start))))"
}

# entries_ok ENTRY...: each entry's binary is built.
entries_ok() {
	local e name module version pkg dir
	for e in "$@"; do
		fields "$e"
		ok "$dir" "$name" || return 1
	done
}

cmd_dir() {
	local want=${1:-} e name module version pkg dir
	[[ -n "$want" ]] || die "dir wants a sidecar name"
	for e in "${SIDECARS[@]}"; do
		fields "$e"
		if [[ "$name" == "$want" ]]; then
			printf '%s\n' "$dir"
			return
		fi
	done
	die "unknown sidecar '${want}'"
}

cmd_list() {
	local e name module version pkg dir
	for e in "${SIDECARS[@]}"; do
		fields "$e"
		printf '%s %s\n' "$name" "${dir}/${name}"
	done
}

case "${1:-build}" in
build) shift; cmd_build "$@" ;;
dir) cmd_dir "${2:-}" ;;
list) cmd_list ;;
-h | --help | help) sed -n '2,26s/^# \{0,1\}//p' "$0" ;;
*) die "unknown subcommand '$1' (want: build, dir, list)" ;;
esac
