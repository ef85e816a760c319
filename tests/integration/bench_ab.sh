#!/bin/bash
# bench/ab against real builds: one daemon and two ranks run a checked
# all_reduce and barrier (and, --mem huge, all_gather and all_to_all of 48
# MiB), the table and the daemon's CPU time are printed; bad options and a
# missing binary are clear usage errors (exit 2).
# usage: bench_ab.sh SOURCE_DIR PARAMSYNCD PARAMSYNC-BENCH
set -u
src=$1 daemon=$2 bench=$3
fail() {
  echo "FAIL: $*"
  exit 1
}

out=$("$src/bench/ab" -p 2 -d "$daemon" -b "$bench" -- -t all_reduce,barrier -b 4 -e 1K -f 16 \
  -n 5 -w 1 2>&1) || fail "bench/ab exited $?: $out"
echo "$out"
grep -q "^# OK: 0 wrong elements" <<<"$out" || fail "no checked results"
grep -Eq "^ +all_reduce +1024 " <<<"$out" || fail "no 1 KiB all_reduce row"
grep -Eq "^ +barrier " <<<"$out" || fail "no barrier row"
grep -Eq "^daemon cpu: [0-9]+\.[0-9]{2} s \(each: [0-9]+\.[0-9]{2}\)$" <<<"$out" || fail "no daemon CPU line"
# --mem huge: buffers on huge pages, large enough for the agent's direct path, checked.
out=$("$src/bench/ab" -p 2 -d "$daemon" -b "$bench" -- -t all_gather,all_to_all -b 48M -e 48M \
  -n 2 -w 1 -m huge 2>&1) || fail "bench/ab --mem huge exited $?: $out"
echo "$out"
grep -q "^# OK: 0 wrong elements" <<<"$out" || fail "--mem huge: no checked results"
grep -Eq "^ +all_to_all +50331648 " <<<"$out" || fail "--mem huge: no 48 MiB all_to_all row"

msg=$("$src/bench/ab" --bogus 2>&1)
[ $? -eq 2 ] || fail "an unknown option did not exit 2"
grep -q "unknown option --bogus" <<<"$msg" || fail "unknown option not named: $msg"
msg=$("$src/bench/ab" -d /nonexistent/paramsyncd -b "$bench" 2>&1)
[ $? -eq 2 ] || fail "a missing daemon did not exit 2"
grep -q "/nonexistent/paramsyncd is not an executable" <<<"$msg" || fail "missing daemon not named: $msg"
msg=$("$src/bench/ab" -p two 2>&1)
[ $? -eq 2 ] || fail "a bad rank count did not exit 2"
"$src/bench/ab" --help | grep -q "^usage: bench/ab" || fail "--help"
echo "OK"
