#!/usr/bin/env bash
# gobuild.sh OUT VERSION PACKAGES...: build this repository's commands the way
# the quickstart and `make` do, saying how far along it is every 10 seconds
# (packages compiled out of those the build depends on, then linking). A
# plain go build is silent for minutes on a cold cache, and nobody can tell a
# slow build from a hung one.
#
# OUT is a file for one package or a folder (ending in /) for several.
# VERSION goes into main.version. Static (CGO_ENABLED=0) and -trimpath, as
# the images' builds (internal/imagebuild) are: with any other setting the
# two share no compiled package that imports net, which is nearly all of
# them, and the first quickstart compiles them twice (3.5 minutes more).
set -euo pipefail
GO=${GO:-go}
export CGO_ENABLED=0
out=$1 version=$2
shift 2

# done_within PID SECONDS: true once PID has ended, false after SECONDS.
done_within() {
	local i
	for ((i = 0; i < $2 * 5; i++)); do
		kill -0 "$1" 2>/dev/null || return 0
		sleep 0.2
	done
	return 1
}

log=$(mktemp) list=$(mktemp)
trap 'rm -f "$log" "$list" "$list.n"' EXIT
mains=$($GO list "$@")
nmains=$(wc -l <<<"$mains")
# The total comes from go list -deps, run beside the build since listing a
# large graph takes seconds; unsafe is in every graph and never compiled.
( $GO list -deps "$@" 2>/dev/null | grep -cvx unsafe > "$list.n" && mv "$list.n" "$list" ) &
start=$(date +%s)
# -v prints each package as it is compiled; a warm cache compiles fewer, so
# the total is an upper bound.
$GO build -v -trimpath -ldflags "-s -w -X main.version=$version" -o "$out" "$@" 2>"$log" &
pid=$!
while ! done_within "$pid" 10; do
	n=$(grep -cv '[[:space:]]' "$log" || true)
	total=$(cat "$list" 2>/dev/null || true)
	if [ "$(grep -cxF -f <(echo "$mains") "$log" || true)" = "$nmains" ]; then
		echo "go build: $n packages compiled, linking ($(( $(date +%s) - start ))s)"
	else
		echo "go build: compiling, $n${total:+/$total} packages ($(( $(date +%s) - start ))s)"
	fi
done
if ! wait "$pid"; then
	tail -40 "$log" >&2
	exit 1
fi
