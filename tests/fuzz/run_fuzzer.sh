#!/bin/sh
# Runs one libFuzzer binary for a bounded time from the committed corpus (ctest LABELS fuzz).
#   run_fuzzer.sh FUZZER CORPUS_DIR REGRESSION_DIR WORK_DIR
# Seconds: $PARAMSYNC_FUZZ_SECONDS, else $PS_FUZZ_DEFAULT_SECONDS (set by
# CMake), else 60. New inputs go to WORK_DIR/corpus, never to the source tree;
# a crash leaves WORK_DIR/artifacts/crash-* (or leak-*, timeout-*, oom-*):
# copy it to REGRESSION_DIR so that the regression runner replays it everywhere.
set -eu
if [ $# -ne 4 ]; then
    sed -n '3,7p' "$0" >&2
    exit 2
fi
fuzzer=$1 corpus=$2 regressions=$3 work=$4
secs=${PARAMSYNC_FUZZ_SECONDS:-${PS_FUZZ_DEFAULT_SECONDS:-60}}
case $secs in '' | *[!0-9]*) echo "run_fuzzer: PARAMSYNC_FUZZ_SECONDS=$secs is not a number" >&2; exit 2 ;; esac

mkdir -p "$work/corpus" "$work/artifacts"
seeds=$corpus
[ -d "$regressions" ] && seeds="$seeds $regressions"
echo "run_fuzzer: $(basename "$fuzzer") for ${secs}s from $seeds"
# -timeout: one input running 10 s is a hang; -rss_limit_mb: a 2 GiB
# allocation from a small input is a bug. The outer timeout only guards
# against the fuzzer itself wedging.
set +e
# shellcheck disable=SC2086 # seeds is a list of directories without spaces
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
timeout $((secs + 300)) "$fuzzer" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" $seeds
rc=$?
set -e
if [ $rc -ne 0 ]; then
    echo "run_fuzzer: FAILED (exit $rc). Reproduce with: $fuzzer <file>" >&2
    ls -l "$work/artifacts" >&2 || true
    echo "run_fuzzer: copy the file to $regressions/ so every build replays it" >&2
fi
exit $rc
