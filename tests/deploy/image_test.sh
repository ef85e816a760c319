#!/usr/bin/env bash
# The container image, built and run: scripts/image builds deploy/image/Dockerfile
# with podman from this tree; a coordinator and two agents run as containers on
# the host network (distinct ports, read-only root, no capabilities); four
# Python workers on the host (two per agent) run an all_reduce of 4 MiB each
# through them, and every rank checks the sum. Then the daemons' /metrics are
# scraped, if this paramsyncd has --metrics-addr; the workers' image (target
# python) runs deploy/k8s/examples/train.py in four containers with env://,
# as the example Job does; and each daemon must stop on SIGTERM with status 0.
#
# Exit 0 passed, 1 failed, 77 skipped (not root, or podman / grpc missing).
# The debootstrap base and the build stage's packages stay cached in
# scripts/image's podman store between runs; containers go away on any exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/deploy
py=/usr/bin/python3
export PARAMSYNC_IMAGE=${PARAMSYNC_TEST_IMAGE:-localhost/paramsync:test}
img=$root/scripts/image

skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

[ "$(id -u)" -eq 0 ] || skip "needs root (podman with its own store, debootstrap)"
command -v podman >/dev/null || skip "podman is not installed (scripts/setup installs it)"
command -v runc >/dev/null || skip "runc is not installed (scripts/setup installs it)"
$py -c 'import grpc, google.protobuf' 2>/dev/null ||
    skip "$py lacks grpc/protobuf (python3-grpcio, python3-protobuf)"
command -v protoc >/dev/null && [ -x /usr/bin/grpc_python_plugin ] ||
    skip "protoc or grpc_python_plugin missing (protobuf-compiler, protobuf-compiler-grpc)"

t_all=$(now)
tmp=$(mktemp -d /tmp/paramsync-image-test.XXXXXX)
names=()
pids=()
cleanup() {
    local rc=$?
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then
        for n in "${names[@]}"; do
            echo "---- podman logs $n ----" >&2
            "$img" podman logs "$n" 2>&1 | tail -n 40 >&2 || true
        done
    fi
    for n in "${names[@]}"; do "$img" podman rm --force --time 2 "$n" >/dev/null 2>&1 || true; done
    rm -rf "$tmp"
    exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Containers left by a run that was killed (ctest's timeout sends SIGKILL,
# which no trap sees): their names carry the pid of a test no longer running.
if "$img" podman ps -a --format '{{.Names}}' >"$tmp/old" 2>/dev/null; then
    while read -r n; do
        p=${n#pstest-}
        p=${p%%-*}
        case "$p" in '' | *[!0-9]*) continue ;; esac
        kill -0 "$p" 2>/dev/null || "$img" podman rm --force --time 2 "$n" >/dev/null 2>&1 || true
    done < <(grep '^pstest-' "$tmp/old" || true)
fi

echo "== build the image ($PARAMSYNC_IMAGE)"
t=$(now)
"$img" build --tag "$PARAMSYNC_IMAGE"
echo "build: $(since "$t") s"
labels=$("$img" podman image inspect "$PARAMSYNC_IMAGE" \
    --format '{{.Config.User}} {{index .Config.Labels "org.opencontainers.image.title"}}')
[ "$labels" = "65532:65532 paramsyncd" ] || fail "image user/title label: '$labels'"

# Free TCP ports on loopback for 3 gRPC servers and 3 metrics servers.
read -r -a ports < <($py -c '
import socket
ss = [socket.socket() for _ in range(6)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')
coord=127.0.0.1:${ports[0]} a1=127.0.0.1:${ports[1]} a2=127.0.0.1:${ports[2]}

metrics=0
help=$("$img" run -- --help)
if grep -q -- '--metrics-addr' <<<"$help"; then
    metrics=1
    m0=127.0.0.1:${ports[3]} m1=127.0.0.1:${ports[4]} m2=127.0.0.1:${ports[5]}
else
    echo "metrics: SKIPPED: this paramsyncd has no --metrics-addr yet (paramsyncd --help)"
fi

tag=pstest-$$
# As Kubernetes runs them (deploy/k8s): read-only root, no capabilities, no
# privilege escalation; --init=false so paramsyncd is PID 1 and gets SIGTERM.
run_opts=(--detach --read-only --cap-drop=ALL --security-opt=no-new-privileges
    --tmpfs /tmp:rw,size=16m)
start() { # NAME PODMAN_OPTS... -- DAEMON_ARGS...
    local n=$1
    shift
    names+=("$n")
    "$img" run --keep --name "$n" "${run_opts[@]}" "$@" >/dev/null
}
wait_listening() { # NAME
    local n=$1 i
    for i in $(seq 1 150); do
        if "$img" podman logs "$n" 2>&1 | grep -q "paramsyncd: listening on"; then return 0; fi
        if [ "$("$img" podman inspect --format '{{.State.Running}}' "$n")" != true ]; then
            fail "container $n exited before listening"
        fi
        sleep 0.2
    done
    fail "container $n not listening after 30 s"
}

echo "== start a coordinator and two agents"
t=$(now)
mflag() { [ $metrics -eq 1 ] && echo "--metrics-addr=$1" || true; }
# The coordinator and agent 1 take flags; agent 2 takes the environment alone.
# shellcheck disable=SC2046
start "$tag-coordinator" -- --role coordinator --listen "$coord" $(mflag "${m0:-}")
wait_listening "$tag-coordinator"
# shellcheck disable=SC2046
start "$tag-agent1" -- --role agent --listen "$a1" --advertise "$a1" --coordinator "$coord" \
    $(mflag "${m1:-}")
env2=(-e PARAMSYNC_ROLE=agent -e "PARAMSYNC_LISTEN=$a2" -e "PARAMSYNC_ADVERTISE=$a2"
    -e "PARAMSYNC_COORDINATOR=$coord")
[ $metrics -eq 1 ] && env2+=(-e "PARAMSYNC_METRICS_ADDR=$m2")
start "$tag-agent2" "${env2[@]}" --
wait_listening "$tag-agent1"
wait_listening "$tag-agent2"
for n in "${names[@]}"; do
    u=$("$img" podman exec "$n" id -u)
    [ "$u" = 65532 ] || fail "$n runs as uid $u, expected 65532"
done
echo "containers up (uid 65532): $(since "$t") s"

echo "== workers: all_reduce, world 4, ranks 0-1 on agent 1, ranks 2-3 on agent 2"
t=$(now)
stubs=$tmp/stubs
mkdir -p "$stubs"
protoc -I "$root/proto" --python_out="$stubs" --grpc_out="$stubs" \
    --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin "$root/proto/paramsync/v1/paramsync.proto"
touch "$stubs/paramsync/__init__.py" "$stubs/paramsync/v1/__init__.py"
$py "$here/allreduce_worker.py" --stubs "$stubs" --addr "$coord" --wait-agents 2 --timeout 30
for r in 0 1 2 3; do
    addr=$a1
    [ $r -ge 2 ] && addr=$a2
    $py "$here/allreduce_worker.py" --stubs "$stubs" --addr "$addr" --job "image-test-$$" \
        --world 4 --rank $r --count $((1 << 20)) --timeout 60 >"$tmp/worker$r.log" 2>&1 &
    pids+=($!)
done
bad=0
for i in 0 1 2 3; do
    if wait "${pids[$i]}"; then cat "$tmp/worker$i.log"; else
        bad=1
        echo "rank $i failed:" >&2
        cat "$tmp/worker$i.log" >&2
    fi
done
pids=()
[ $bad -eq 0 ] || fail "all_reduce through the containers"
echo "all_reduce: $(since "$t") s"

if [ $metrics -eq 1 ]; then
    echo "== /metrics"
    $py "$here/check_metrics.py" --all-reduce 4 "http://$m0/metrics" "http://$m1/metrics" \
        "http://$m2/metrics"
fi

echo "== the workers' image: deploy/k8s/examples/train.py with env:// in 4 containers"
if [ -f "$root/client/python/setup.py" ]; then
    t=$(now)
    pyimage=${PARAMSYNC_IMAGE%:*}-python:${PARAMSYNC_IMAGE##*:}
    "$img" build --target python --tag "$pyimage" >"$tmp/python-build.log" 2>&1 ||
        { tail -n 40 "$tmp/python-build.log" >&2; fail "building the python target"; }
    echo "python image build: $(since "$t") s"
    t=$(now)
    for r in 0 1 2 3; do
        port=${a1##*:}
        [ $r -ge 2 ] && port=${a2##*:}
        n=$tag-worker$r
        names+=("$n")
        # As the example Job's pods get it: MASTER_ADDR/MASTER_PORT (their
        # node's agent), WORLD_SIZE, RANK, a job id; read-only root, non-root.
        PARAMSYNC_IMAGE=$pyimage "$img" run --keep --name "$n" --detach --read-only \
            --cap-drop=ALL --security-opt=no-new-privileges \
            -v "$root/deploy/k8s/examples/train.py:/opt/example/train.py:ro" \
            -e MASTER_ADDR=127.0.0.1 -e MASTER_PORT="$port" -e WORLD_SIZE=4 -e RANK=$r \
            -e PARAMSYNC_JOB="example-$$" -- python3 /opt/example/train.py >/dev/null
    done
    for r in 0 1 2 3; do
        n=$tag-worker$r
        code=$("$img" podman wait "$n")
        "$img" podman logs "$n" 2>&1 | tail -n 1
        [ "$code" = 0 ] || fail "python worker $r exited $code"
    done
    echo "python workers: $(since "$t") s"
else
    echo "python workers: SKIPPED: client/python is not in this tree"
fi

echo "== SIGTERM: every daemon exits 0"
for n in "$tag-agent2" "$tag-agent1" "$tag-coordinator"; do
    "$img" podman stop --time 20 "$n" >/dev/null
    code=$("$img" podman inspect --format '{{.State.ExitCode}}' "$n")
    [ "$code" = 0 ] || fail "$n exited $code after SIGTERM"
done
echo "image test: passed in $(since "$t_all") s (metrics $([ $metrics -eq 1 ] && echo checked || echo SKIPPED))"
