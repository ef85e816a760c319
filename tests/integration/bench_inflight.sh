#!/bin/bash
# paramsync-bench --inflight against a real paramsyncd: two ranks start K
# nonblocking all_reduces and barriers at once, every result checked (the
# bench counts wrong elements), each through a doorbell of its own when the
# agent is on this host; and --inflight with a collective it does not take,
# past its limit, or with --mem device, is a clear usage error; --mem device
# without a usable CUDA device exits 77 with the reason. all_to_all_v's
# uneven blocks, checked.
# usage: bench_inflight.sh PARAMSYNCD PARAMSYNC-BENCH
set -u
daemon=$1 bench=$2
# shellcheck source=tests/integration/daemon_lib.sh
. "$(dirname "$0")/daemon_lib.sh"
daemon_lib_init bench-inflight
start_daemon -- "$daemon"

for shm in 1 0; do
  pids=()
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 PARAMSYNC_ADDR=$addr PARAMSYNC_JOB=inflight-$shm PARAMSYNC_SHM=$shm \
      "$bench" -t all_reduce,barrier -b 4 -e 256K -f 16 -w 2 -n 10 -a 6 -d int32 \
      > "$work/rank$r-shm$shm.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}" || fail "PARAMSYNC_SHM=$shm: rank $i exited $?"
  done
  log=$work/rank0-shm$shm.log
  grep -q "6 nonblocking calls in flight at once" "$log" || fail "no --inflight in the header"
  grep -q "^# OK: 0 wrong elements in all" "$log" || fail "PARAMSYNC_SHM=$shm: results not all right"
  rows=$(grep -c "^ *\(all_reduce\|barrier\) " "$log")
  [ "$rows" -eq 6 ] || fail "PARAMSYNC_SHM=$shm: $rows result rows, want 5 sizes of all_reduce and a barrier"
  echo "PARAMSYNC_SHM=$shm: $rows rows, 0 wrong, 6 calls in flight"
done

# Usage errors: exit 2 with a message that says what is wrong, before any call.
out=$(RANK=0 WORLD_SIZE=1 PARAMSYNC_ADDR=$addr "$bench" -a 2 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "inflight takes all_reduce and barrier only, not broadcast" <<< "$out" ||
  fail "--inflight with every collective: exit $rc, said: $out"
out=$(RANK=0 WORLD_SIZE=1 PARAMSYNC_ADDR=$addr "$bench" -t barrier -a 65 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "bad value '65' for -a" <<< "$out" ||
  fail "--inflight 65: exit $rc, said: $out"
out=$(RANK=0 WORLD_SIZE=1 PARAMSYNC_ADDR=$addr "$bench" -t all_reduce -a 2 -m device 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "mem device takes blocking calls only" <<< "$out" ||
  fail "--inflight with --mem device: exit $rc, said: $out"
out=$(RANK=0 WORLD_SIZE=1 PARAMSYNC_ADDR=$addr "$bench" -t all_to_all_v -m device 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "all_to_all_v takes host memory, not --mem device" <<< "$out" ||
  fail "all_to_all_v with --mem device: exit $rc, said: $out"
echo "usage errors: clear"

# all_to_all_v (uneven blocks: rank r sends rank j u (1 + (r + j) mod 3) elements), checked,
# beside the even all_to_all, through shared memory and over gRPC.
for shm in 1 0; do
  pids=()
  for r in 0 1 2; do
    RANK=$r WORLD_SIZE=3 PARAMSYNC_ADDR=$addr PARAMSYNC_JOB=a2av-$shm PARAMSYNC_SHM=$shm \
      "$bench" -t all_to_all,all_to_all_v -b 4 -e 4M -f 32 -w 1 -n 3 -d int32 \
      > "$work/a2av$r-shm$shm.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2; do
    wait "${pids[$i]}" || fail "all_to_all_v, PARAMSYNC_SHM=$shm: rank $i exited $?"
  done
  log=$work/a2av0-shm$shm.log
  grep -q "^# OK: 0 wrong elements in all" "$log" || fail "all_to_all_v, PARAMSYNC_SHM=$shm: results not all right"
  rows=$(grep -c "^ *all_to_all_v " "$log")
  [ "$rows" -eq 5 ] || fail "all_to_all_v, PARAMSYNC_SHM=$shm: $rows rows, want 5 sizes"
  echo "all_to_all_v, PARAMSYNC_SHM=$shm: $rows rows, 0 wrong"
done
# --mem device where no CUDA device is usable (here, or a build without CUDA): the skip code and
# a reason, from every rank; on a GPU host it runs, results checked.
out=$(RANK=0 WORLD_SIZE=1 PARAMSYNC_ADDR=$addr PARAMSYNC_JOB=device "$bench" -t all_reduce \
  -b 4K -e 4K -n 2 -w 1 -m device 2>&1)
rc=$?
if [ $rc -eq 77 ]; then
  grep -q "rank 0: --mem device: no usable CUDA device" <<< "$out" ||
    fail "--mem device without a device: said: $out"
  echo "SKIPPED: --mem device: no CUDA device here (exit 77, reason given)"
else
  [ $rc -eq 0 ] && grep -q "buffers in CUDA device memory" <<< "$out" &&
    grep -q "^# OK: 0 wrong elements in all" <<< "$out" || fail "--mem device: exit $rc, said: $out"
  echo "--mem device: 0 wrong"
fi
echo PASS
