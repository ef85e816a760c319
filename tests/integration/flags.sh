#!/usr/bin/env bash
# paramsyncd's command line: each bad value (as a flag and as its environment variable) exits 2
# with a message naming the flag and the value, before anything is served; --help names every
# environment variable the daemon reads; --version prints the version.
#
# usage: flags.sh PARAMSYNCD MAIN_C   (MAIN_C: server/main.c, where the variables are listed)
set -u
daemon=$1
main_c=$2
fails=0
fail() {
  echo "flags.sh: FAIL: $*"
  fails=$((fails + 1))
}

# expect_run WHAT RC GLOB [VAR=VALUE...] -- ARGS...: the daemon, given ARGS and the VARs in
# its environment, exits RC within 3 s (124: it was still serving then) with a stderr that
# matches GLOB; prints ok then, else returns 1 leaving the run in last_rc and last_err.
expect_run() {
  local what=$1 want_rc=$2 glob=$3 envs=()
  shift 3
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  last_err=$(env -u PARAMSYNC_RING "${envs[@]}" timeout 3 "$daemon" "$@" 2>&1 >/dev/null)
  last_rc=$?
  # shellcheck disable=SC2053 # GLOB is a pattern on purpose
  [ "$last_rc" = "$want_rc" ] && [[ "$last_err" == $glob ]] || return 1
  echo "ok: $what -> $(printf '%.160s' "$last_err" | tr '\n' ' ')"
}

# expect_bad 'MESSAGE' ARGS...: the daemon exits 2, its stderr holding MESSAGE.
expect_bad() {
  local want=$1
  shift
  expect_run "paramsyncd $(printf '%.60s' "$*")" 2 "*$want*" -- "$@" ||
    fail "paramsyncd $* exited $last_rc (want 2, saying '$want'): $last_err"
}

long=$(printf 'x%.0s' $(seq 200))
expect_bad "--ring must be auto, on or off, not 'bogus'" --ring bogus
expect_bad "--ring-min-bytes must be a byte count, not '12Q'" --ring-min-bytes 12Q
expect_bad "--ring-min-bytes must be a byte count, not '-1'" --ring-min-bytes -1
expect_bad "--rd-max-bytes must be a byte count, not '12Q'" --rd-max-bytes 12Q
expect_bad "--reduce-device must be cpu, cuda or auto, not 'gpu'" --reduce-device gpu
expect_bad "--machine-id is at most 128 characters" --machine-id "$long"
expect_bad "--step-bytes must be 64 bytes to 4M-4K, not '0'" --step-bytes 0
expect_bad "--timeout-ms wants a positive number of ms, not '-5'" --timeout-ms -5
expect_bad "--role must be embedded, coordinator or agent, not 'worker'" --role worker
expect_bad "--link-keep-ms must be 0 to 3600000, not '3600001'" --link-keep-ms 3600001
expect_bad "--link-keep-ms must be 0 to 3600000, not 'soon'" --link-keep-ms soon
expect_bad "unrecognized option '--bogus'" --bogus
# The same values through the environment.
expect_run "PARAMSYNC_RING=sideways" 2 "*--ring must be auto, on or off, not 'sideways'*" \
  PARAMSYNC_RING=sideways -- || fail "PARAMSYNC_RING=sideways: exit $last_rc, '$last_err'"
expect_run "PARAMSYNC_RD_MAX_BYTES=lots" 2 "*--rd-max-bytes must be a byte count, not 'lots'*" \
  PARAMSYNC_RD_MAX_BYTES=lots -- || fail "PARAMSYNC_RD_MAX_BYTES=lots: exit $last_rc, '$last_err'"
expect_run "PARAMSYNC_LINK_KEEP_MS=-1" 2 "*--link-keep-ms must be 0 to 3600000, not '-1'*" \
  PARAMSYNC_LINK_KEEP_MS=-1 -- || fail "PARAMSYNC_LINK_KEEP_MS=-1: exit $last_rc, '$last_err'"
expect_run "PARAMSYNC_MACHINE_ID of 200 characters" 2 "*--machine-id is at most 128 characters*" \
  PARAMSYNC_MACHINE_ID="$long" -- ||
  fail "PARAMSYNC_MACHINE_ID of 200 characters: exit $last_rc, '$last_err'"

# --reduce-device: cuda refuses to start without a usable device, saying so; on a host with
# one (and for auto either way) the start-up line says where steps are reduced.
serve=(--listen 127.0.0.1:0 --metrics-addr off)
expect_run "--reduce-device cuda, no device" 2 "*--reduce-device cuda, but no CUDA device can be used*" \
  -- "${serve[@]}" --reduce-device cuda ||
  expect_run "--reduce-device cuda, a device" 124 "*reduce on cuda (*" \
    -- "${serve[@]}" --reduce-device cuda ||
  fail "--reduce-device cuda: exit $last_rc, '$last_err'"
expect_run "--reduce-device auto, no device" 124 "*reduce on cpu (*" \
  -- "${serve[@]}" --reduce-device auto ||
  expect_run "--reduce-device auto, a device" 124 "*reduce on cuda from 1024 KiB per input, cpu below (*" \
    -- "${serve[@]}" --reduce-device auto ||
  fail "--reduce-device auto: exit $last_rc, '$last_err'"

help=$("$daemon" --help) || fail "--help exited $?"
vars=$(grep -o '"PARAMSYNC_[A-Z_]*"' "$main_c" | tr -d '"' | sort -u)
[ -n "$vars" ] || fail "no PARAMSYNC_ variables found in $main_c"
n=0
missing=0
for v in $vars; do
  n=$((n + 1))
  if ! grep -Eq "(^|[^A-Z_])$v([^A-Z_]|\$)" <<<"$help"; then
    fail "--help does not name $v"
    missing=$((missing + 1))
  fi
done
[ $missing = 0 ] && echo "ok: --help names all $n environment variables of $main_c"
version=$("$daemon" --version) || fail "--version exited $?"
[[ "$version" == "paramsyncd "[0-9]* ]] || fail "--version printed '$version'"

[ $fails = 0 ] || { echo "flags.sh: $fails failed"; exit 1; }
echo "flags.sh: passed"
