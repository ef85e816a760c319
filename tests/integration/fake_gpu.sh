#!/bin/bash
# The agent's CUDA path where no GPU is: paramsyncd-fakegpu (the daemon linked with fake_gpu.c, a
# device made of host memory that checks how it is used) serves real paramsync-bench ranks.
#   auto: 4 KiB steps reduce on the CPU, 1 MiB ones on the device, shared-memory, malloc and
#         gRPC buffers alike, every result right; every buffer the device path met was pinned
#         (segments registered at attach, pinned blobs for the rest), segments unpinned while
#         still mapped, the daemon exits cleanly; the device wrote each step's result into
#         every shared-memory rank's segment itself in each all_reduce's last step (one
#         call, a dst per rank, no blob), and into a pinned blob for the rest;
#   cuda: every step on the device;
#   cuda with pinning refused: one warning, the segments staged and written by the CPU,
#         results still right;
#   cuda with the device failing: the CPU reduces instead, results right, also in a step
#         whose one receiver's segment the device was to write; but where a segment the
#         device was to write is an input too (in place), INTERNAL, not a reduction of what
#         it may have half-written.
# usage: fake_gpu.sh PARAMSYNCD-FAKEGPU PARAMSYNC-BENCH
set -u
daemon=$1 bench=$2
# shellcheck source=tests/integration/daemon_lib.sh
. "$(dirname "$0")/daemon_lib.sh"
daemon_lib_init fake-gpu

# start DEVICE [VAR=VALUE...]: a daemon reducing on DEVICE; sets addr and metrics (host:port).
start() {
  local dev=$1
  shift
  rm -f "$work/report"
  start_daemon "$@" PS_FAKEGPU_REPORT="$work/report" -- "$daemon" --metrics-addr 127.0.0.1:0 \
    --reduce-device "$dev"
  metrics=$(sed -n 's|^paramsyncd: metrics on http://\([^/]*\)/metrics.*|\1|p' "$work/daemon.log")
  [ -n "$metrics" ] || fail "no metrics address in the daemon's log"
}

# stop: SIGTERM; the daemon must exit 0 (fake_gpu aborts on a misuse) and write its report.
stop() {
  kill "$dpid"
  wait "$dpid"
  local rc=$?
  dpid=
  [ $rc = 0 ] || fail "paramsyncd-fakegpu exited $rc"
  [ -s "$work/report" ] || fail "no report from fake_gpu (did the device path run?)"
  read -r _ calls _ pinned _ staged _ registered _ unregistered _ stagers _ multi _ dsts \
    < "$work/report"
}

# ranks P JOB VAR=VALUE... -- BENCH-ARGS: P ranks of paramsync-bench, every result checked.
ranks() {
  local p=$1 job=$2 vars=() pids=()
  shift 2
  while [ "$1" != -- ]; do vars+=("$1"); shift; done
  shift
  for r in $(seq 0 $((p - 1))); do
    env "${vars[@]}" RANK="$r" WORLD_SIZE="$p" PARAMSYNC_ADDR="$addr" PARAMSYNC_JOB="$job" \
      "$bench" -t all_reduce -d float32 "$@" > "$work/$job.$r.log" 2>&1 &
    pids+=($!)
  done
  for r in $(seq 0 $((p - 1))); do
    wait "${pids[$r]}" || fail "$job: rank $r exited $?"
  done
  grep -q "^# OK: 0 wrong elements in all" "$work/$job.0.log" || fail "$job: wrong results"
}

# series NAME LABELS: the value of the daemon's metric NAME{LABELS}.
series() {
  exec 3<> "/dev/tcp/${metrics%:*}/${metrics##*:}" || fail "cannot reach the metrics"
  printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  sed -n "s/^$1{$2} \([0-9]*\).*/\1/p" <&3
  exec 3<&-
}
# reduced DEVICE: the daemon's paramsync_reduced_bytes_total for DEVICE.
reduced() { series paramsync_reduced_bytes_total "device=\"$1\""; }
# written_by_device: result bytes the device wrote into workers' segments itself.
written_by_device() { series paramsync_shm_bytes_total 'direction="sent",access="device"'; }

# auto: 4 KiB and 4 MiB all_reduces of 3 ranks, through shared memory, malloc buffers (the
# payload segment) and gRPC frames.
start auto
grep -q "reduce on cuda from 1024 KiB per input, cpu below" "$work/daemon.log" ||
  fail "auto: the start-up line does not say where steps reduce"
for how in "shared PARAMSYNC_SHM=1" "malloc PARAMSYNC_SHM=1" "malloc PARAMSYNC_SHM=0"; do
  read -r mem var <<< "$how"
  ranks 3 "auto-$mem-${var#*=}" "$var" -- -m "$mem" -b 4K -e 4M -f 1024 -n 3 -w 1
done
cpu=$(reduced cpu) cuda=$(reduced cuda) by_device=$(written_by_device)
step=$((3 << 20)) # a 1 MiB step of 3 inputs
echo "auto: reduced on the cpu $cpu bytes, on the device $cuda"
[ -n "$cpu" ] && [ "$cpu" -gt 0 ] && [ "$cpu" -lt $((1 << 20)) ] ||
  fail "auto: $cpu bytes on the CPU, want the 4 KiB steps only (0 < bytes < 1 MiB)"
[ -n "$cuda" ] && [ $((cuda % step)) = 0 ] && [ "$cuda" -ge $((3 * 4 * 4 * step)) ] ||
  fail "auto: $cuda bytes on the device, want whole 1 MiB steps of 3 inputs, 4 per call, >= 4 calls x 3 runs"
pins=$(grep -c "pinned for CUDA" "$work/daemon.log")
# The ranks have left: their segments are unpinned (and unmapped); the pinned buffers stay.
for _ in $(seq 50); do
  pinned_segments=$(series paramsync_pinned_bytes 'kind="segments"')
  [ "$pinned_segments" = 0 ] && break
  sleep 0.1
done
pinned_buffers=$(series paramsync_pinned_bytes 'kind="buffers"')
echo "auto: paramsync_pinned_bytes after the ranks left: segments $pinned_segments, buffers" \
  "$pinned_buffers"
[ "$pinned_segments" = 0 ] || fail "auto: $pinned_segments bytes of segments still pinned"
[ -n "$pinned_buffers" ] && [ $((pinned_buffers % (1 << 16))) = 0 ] && [ "$pinned_buffers" -gt 0 ] &&
  [ "$pinned_buffers" -le $((512 << 20)) ] ||
  fail "auto: $pinned_buffers bytes of pinned buffers, want 64 KiB classes, 512 MiB at most"
stop
echo "auto: fake_gpu: $calls reductions, $pinned buffers pinned, $staged staged," \
  "$registered segments registered ($pins logged), $unregistered unregistered, $stagers stagers"
[ "$calls" = $((cuda / step)) ] || fail "auto: $calls device reductions, the metrics say $((cuda / step))"
[ "$staged" = 0 ] || fail "auto: $staged buffers were not pinned (the device path would copy them)"
# Two runs of three in shared memory: the last of each 4 MiB all_reduce's 4 steps into the 3
# ranks' segments, no blob; the other steps, and the gRPC run's, into one blob.
echo "auto: $multi reductions wrote $dsts segments, $by_device bytes by the device"
[ $((multi * 6)) = "$calls" ] && [ "$dsts" = $((multi * 3)) ] ||
  fail "auto: $multi of $calls reductions wrote $dsts segments; want 1 in 6, 3 each"
[ "$by_device" = $((dsts << 20)) ] ||
  fail "auto: $by_device bytes written by the device, want $dsts 1 MiB steps"
[ "$pinned" = $((calls * 3 + dsts + calls - multi)) ] ||
  fail "auto: $pinned pinned buffers, want 3 inputs and every dst per reduction"
[ "$registered" -ge 3 ] && [ "$registered" = "$pins" ] ||
  fail "auto: $registered segments registered, $pins logged; want one per rank at least"
[ "$unregistered" -le "$registered" ] || fail "auto: more segments unregistered than registered"
[ "$stagers" -ge 1 ] && [ "$stagers" -le "$calls" ] || fail "auto: $stagers stagers for $calls reductions"

# 16 MiB from 2 ranks in shared memory: 16 steps, of which the device writes the segments of the
# last itself; the CPU copies the 15 before, overlapping the device's later work.
start auto
ranks 2 window PARAMSYNC_SHM=1 -- -m shared -b 16M -e 16M -n 2 -w 1
cuda=$(reduced cuda) by_device=$(written_by_device)
stop
echo "16 MiB: $calls reductions on the device, $multi wrote $dsts segments, $by_device bytes"
[ "$calls" = $((cuda / (2 << 20))) ] && [ "$calls" -ge 48 ] ||
  fail "16 MiB: $calls device reductions for $cuda bytes, want 1 MiB steps of 2, 16 per call"
[ $((multi * 16)) = "$calls" ] && [ "$dsts" = $((multi * 2)) ] ||
  fail "16 MiB: $multi of $calls reductions wrote $dsts segments; want 1 in 16, both ranks"
[ "$by_device" = $((dsts << 20)) ] || fail "16 MiB: $by_device bytes by the device, want $dsts MiB"

# cuda: every step on the device, small ones too.
start cuda
ranks 2 cuda-small PARAMSYNC_SHM=1 -- -m shared -b 4 -e 64K -f 16 -n 3 -w 1
cpu=$(reduced cpu) cuda=$(reduced cuda)
echo "cuda: reduced on the cpu $cpu bytes, on the device $cuda"
[ "$cpu" = 0 ] && [ "$cuda" -gt 0 ] || fail "cuda: $cpu bytes on the CPU, $cuda on the device"
stop

# A daemon on the CPU pins nothing.
start cpu
ranks 2 cpu PARAMSYNC_SHM=1 -- -m shared -b 1M -e 1M -n 2 -w 1
for k in segments buffers; do
  v=$(series paramsync_pinned_bytes "kind=\"$k\"")
  [ "$v" = 0 ] || fail "cpu: paramsync_pinned_bytes{kind=\"$k\"} is '$v', want 0"
done
kill "$dpid"
wait "$dpid" || fail "the cpu daemon exited $?"
dpid=

# Pinning refused: one warning, the segments staged through the CPU, the results right.
start cuda PS_FAKEGPU_REGISTER=fail
ranks 2 nopin-a PARAMSYNC_SHM=1 -- -m shared -b 1M -e 1M -n 3 -w 1
ranks 2 nopin-b PARAMSYNC_SHM=1 -- -m shared -b 1M -e 1M -n 3 -w 1
warned=$(grep -c "pinning .* for CUDA failed" "$work/daemon.log")
by_device=$(written_by_device)
stop
[ "$by_device" = 0 ] && [ "$multi" = 0 ] ||
  fail "pinning refused: $by_device bytes written by the device into $dsts segments, want 0"
echo "pinning refused: $warned warning(s), $staged buffers staged, $pinned pinned"
[ "$warned" = 1 ] || fail "pinning refused: $warned warnings, want one"
[ "$registered" = 0 ] && [ "$staged" -gt 0 ] ||
  fail "pinning refused: $registered registered, $staged staged; want the inputs staged"

# The device fails every reduction. A reduce_scatter of 2 ranks, 4 MiB each from its segment
# into another place of it: the last step's one receiver is placed (no blob written), and
# the CPU reduces it into the step's buffer instead.
start cuda PS_FAKEGPU_REDUCE=fail
ranks 2 fail-rs PARAMSYNC_SHM=1 -- -t reduce_scatter -m shared -b 8M -e 8M -n 2 -w 1
cpu=$(reduced cpu) cuda=$(reduced cuda)
echo "device failing: reduce_scatter reduced on the cpu $cpu bytes, on the device $cuda"
[ "$cuda" = 0 ] && [ "$cpu" -gt 0 ] || fail "device failing: $cpu bytes on the CPU, $cuda on it"
# An all_reduce in place: each rank's placed output is its input.
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 PARAMSYNC_ADDR=$addr PARAMSYNC_JOB=fail-ar PARAMSYNC_SHM=1 \
    "$bench" -t all_reduce -m shared -b 1M -e 1M -n 1 -w 0 > "$work/fail-ar.$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}" && fail "device failing: the in-place all_reduce of rank $r succeeded"
done
grep -q "all_reduce failed: .*internal" "$work/fail-ar.0.log" ||
  fail "device failing: rank 0 did not fail with INTERNAL: $(cat "$work/fail-ar.0.log")"
grep -q "after it may have written a rank's input in place" "$work/daemon.log" ||
  fail "device failing: the daemon did not say why"
stop
echo "device failing: the in-place all_reduce failed with INTERNAL, as it must"
echo PASS
