#!/usr/bin/env bash
# rss-floor.sh measures the resident memory a process needs just for the
# libraries a csibroker proxy (and broker) are built on, next to an idle
# csibroker-proxy measured the same way. Each layer of test/rssfloor/floor is
# built with its build tags (stripped, CGO off, as `make build`), run REPS
# times, and prints VmRSS, RssFile and RssAnon 2 s after its work and a GC.
#
# Usage: hack/rss-floor.sh [REPS]   (default 3; `make rss-floor`)
#
# Everything listens on loopback or unix sockets in a temporary directory,
# and every process started is stopped by its PID.
set -euo pipefail

REPS=${1:-3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d)
PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$WORK"
}
trap cleanup EXIT

build() { (cd "$ROOT" && CGO_ENABLED=0 GOWORK=off go build -trimpath -ldflags '-s -w' "$@"); }

LAYERS=("" "metrics" "tracing" "metrics,tracing" "metrics,tracing,grpc" "metrics,tracing,grpc,clientgo")
for i in "${!LAYERS[@]}"; do
	build -tags "${LAYERS[$i]}" -o "$WORK/floor-$i" ./test/rssfloor/floor
done
build -o "$WORK/" ./cmd/csibroker ./cmd/csibroker-proxy

# freeports: two loopback TCP ports nothing listens on (bash and awk only:
# a port whose connect is refused is free).
freeports() {
	local found=() p
	while ((${#found[@]} < 2)); do
		p=$((20000 + RANDOM % 30000))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			found+=("$p")
		fi
	done
	echo "${found[@]}"
}

# ready PORT: /readyz on 127.0.0.1:PORT answers 200.
ready() {
	local line
	exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
	printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
	read -r line <&3
	exec 3<&-
	[[ $line == *" 200 "* ]]
}

# mb BYTES: bytes in MB, one decimal.
mb() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1000000 }'; }

# status PID: "VmRSS RssFile RssAnon" in KiB.
status() {
	awk '/^VmRSS:/ {r=$2} /^RssFile:/ {f=$2} /^RssAnon:/ {a=$2} END {print r, f, a}' "/proc/$1/status"
}

printf '%-48s %10s %10s %10s %12s\n' "process" "VmRSS KiB" "RssFile" "RssAnon" "binary MB"
for i in "${!LAYERS[@]}"; do
	size=$(stat -c %s "$WORK/floor-$i")
	for ((r = 1; r <= REPS; r++)); do
		read -r name rss file anon < <(timeout 60 "$WORK/floor-$i")
		printf '%-48s %10s %10s %10s %12s\n' "floor: $name" "$rss" "$file" "$anon" "$(mb "$size")"
	done
done

# An idle csibroker-proxy in front of the sample driver, after /readyz.
"$WORK/csibroker" certs --dir "$WORK/certs" --trust-domain floor.test --driver floor.csi.test >/dev/null
size=$(stat -c %s "$WORK/csibroker-proxy")
for ((r = 1; r <= REPS; r++)); do
	d="$WORK/run-$r"
	mkdir -p "$d"
	"$WORK/csibroker" sample-driver --endpoint "unix://$d/drv.sock" --name floor.csi.test --node-id n1 --state-dir "$d/state" >"$d/driver.log" 2>&1 &
	drv=$!
	PIDS+=("$drv")
	read -r port hport < <(freeports)
	"$WORK/csibroker-proxy" --driver-endpoint "unix://$d/drv.sock" --listen "127.0.0.1:$port" \
		--trust-domain floor.test --tls-cert "$WORK/certs/proxy-floor.csi.test.crt" --tls-key "$WORK/certs/proxy-floor.csi.test.key" \
		--tls-ca "$WORK/certs/ca.crt" --http-endpoint "127.0.0.1:$hport" >"$d/proxy.log" 2>&1 &
	prx=$!
	PIDS+=("$prx")
	ready=
	for ((t = 0; t < 100; t++)); do
		if ready "$hport" 2>/dev/null; then
			ready=1
			break
		fi
		sleep 0.1
	done
	if [[ -z $ready ]]; then
		echo "csibroker-proxy not ready; its log:" >&2
		cat "$d/proxy.log" >&2
		exit 1
	fi
	sleep 2
	read -r rss file anon < <(status "$prx")
	printf '%-48s %10s %10s %10s %12s\n' "csibroker-proxy, idle after /readyz" "$rss" "$file" "$anon" "$(mb "$size")"
	kill "$prx" "$drv"
	wait "$prx" "$drv" 2>/dev/null || true
done
