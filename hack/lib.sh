# Shared by hack/control-plane.sh, hack/sidecars.sh and hack/jaeger.sh
# (sourced; each defines log first).

# go_env CMD...: run a go command outside any workspace, modules resolved
# as needed, statically linked.
go_env() {
	env GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 "$@"
}

# gorun LOG DIR CMD...: run a go command in DIR, its chatter going to LOG;
# on failure show the end of it and exit. Fetches from the module proxy
# (go get, go mod ...) may fail for a moment: they are tried three times.
gorun() {
	local logf=$1 d=$2 tries=1 i
	shift 2
	case "$1 $2" in "go get" | "go mod") tries=3 ;; esac
	for ((i = 1; ; i++)); do
		printf '\n$ (cd %s && %s)\n' "$d" "$*" >>"$logf"
		if (cd "$d" && go_env "$@") >>"$logf" 2>&1; then
			return 0
		fi
		((i < tries)) || break
		log "retrying in $((i * 10))s: $*"
		sleep $((i * 10))
	done
	log "failed: $* (in ${d}); end of ${logf}:"
	tail -n 40 "$logf" >&2
	exit 1
}

# fmt_secs N: N seconds as 1m05s or 42s.
fmt_secs() {
	local s=$1
	if ((s >= 60)); then printf '%dm%02ds' $((s / 60)) $((s % 60)); else printf '%ds' "$s"; fi
}
