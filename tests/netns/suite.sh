#!/usr/bin/env bash
# The multi-host collective suite: 4 hosts as network namespaces (hosts.sh),
# the coordinator on h0 and one paramsyncd agent per host, and two jobs at
# once with their workers spread over the hosts:
#   job "spread": 8 ranks, rank r on host h(r mod 4) (hub: h0's agent);
#   job "offset": 3 ranks on h3, h2, h1 (rank 0, hence the hub, on h3, away
#                 from the coordinator).
# Every worker (netns-worker) checks every result exactly.
#   suite.sh PARAMSYNCD NETNS_WORKER [DAEMON_ARGS...]   (e.g. --ring on)
# Exits 0 when every rank passed, 1 otherwise, 77 (SKIPPED) where network
# namespaces cannot be made.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hosts=$here/hosts.sh

if [ "${1:-}" = "--inner" ]; then
    worker=$2
    pids=()
    names=()
    start() { # job world rank host
        local log="$PS_NETNS/$1-rank$3.log"
        "$hosts" exec "$4" env PARAMSYNC_ADDR="$("$hosts" agent "$4")" PARAMSYNC_JOB="$1" \
            WORLD_SIZE="$2" RANK="$3" PARAMSYNC_TIMEOUT_MS=60000 PARAMSYNC_JOIN_TIMEOUT_MS=60000 \
            timeout 150 "$worker" >"$log" 2>&1 &
        pids+=($!)
        names+=("$1 rank $3 on $4")
    }
    for r in 0 1 2 3 4 5 6 7; do start spread 8 $r h$((r % 4)); done
    for r in 0 1 2; do start offset 3 $r h$((3 - r)); done
    failed=0
    for i in "${!pids[@]}"; do
        rc=0
        wait "${pids[$i]}" || rc=$?
        if [ $rc -ne 0 ]; then
            failed=1
            echo "FAILED: ${names[$i]} (exit $rc)"
        fi
    done
    cat "$PS_NETNS"/*-rank*.log
    if [ $failed -ne 0 ]; then
        for f in "$PS_NETNS"/coordinator.log "$PS_NETNS"/agent-*.log; do
            echo "== $(basename "$f")"
            tail -n 30 "$f"
        done
        exit 1
    fi
    echo "PASSED: 2 jobs (8 and 3 ranks) over 4 netns hosts"
    exit 0
fi

[ $# -ge 2 ] || {
    echo "usage: $0 PARAMSYNCD NETNS_WORKER [DAEMON_ARGS...]" >&2
    exit 2
}
paramsyncd=$1
worker=$2
rc=0
why=$("$hosts" check) || rc=$?
if [ $rc -eq 77 ]; then
    echo "SKIPPED: $why"
    exit 77
elif [ $rc -ne 0 ]; then
    echo "hosts.sh check failed: $why"
    exit 1
fi
exec "$hosts" run 4 --paramsyncd "$paramsyncd" --metrics-addr off "${@:3}" -- "$0" --inner "$worker"
