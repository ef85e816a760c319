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

# expect_bad 'MESSAGE' ARGS...: the daemon exits 2 within 5 s, its stderr holding MESSAGE.
expect_bad() {
  local want=$1 rc err
  shift
  err=$(env -u PARAMSYNC_RING timeout 5 "$daemon" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ $rc != 2 ]; then
    fail "paramsyncd $* exited $rc (want 2): $err"
  elif [[ "$err" != *"$want"* ]]; then
    fail "paramsyncd $*: '$err' does not say '$want'"
  else
    echo "ok: paramsyncd $(printf '%.60s' "$*") -> $err"
  fi
}

long=$(printf 'x%.0s' $(seq 200))
expect_bad "--ring must be auto, on or off, not 'bogus'" --ring bogus
expect_bad "--ring-min-bytes must be a byte count, not '12Q'" --ring-min-bytes 12Q
expect_bad "--reduce-device must be cpu, cuda or auto, not 'gpu'" --reduce-device gpu
expect_bad "--machine-id is at most 128 characters" --machine-id "$long"
expect_bad "--step-bytes must be 64 bytes to 4M-4K, not '0'" --step-bytes 0
expect_bad "--timeout-ms wants a positive number of ms, not '-5'" --timeout-ms -5
expect_bad "--role must be embedded, coordinator or agent, not 'worker'" --role worker
expect_bad "unrecognized option '--bogus'" --bogus
# The same values through the environment.
err=$(PARAMSYNC_RING=sideways timeout 5 "$daemon" 2>&1 >/dev/null)
rc=$?
if [ $rc = 2 ] && [[ "$err" == *"--ring must be auto, on or off, not 'sideways'"* ]]; then
  echo "ok: PARAMSYNC_RING=sideways -> $err"
else
  fail "PARAMSYNC_RING=sideways: exit $rc, '$err'"
fi
err=$(PARAMSYNC_MACHINE_ID=$long timeout 5 "$daemon" 2>&1 >/dev/null)
rc=$?
if [ $rc = 2 ] && [[ "$err" == *"--machine-id is at most 128 characters"* ]]; then
  echo "ok: PARAMSYNC_MACHINE_ID of 200 characters -> $err"
else
  fail "PARAMSYNC_MACHINE_ID of 200 characters: exit $rc, '$err'"
fi

# --reduce-device: cuda refuses to start without a usable device, saying so; on a host with
# one (and for auto either way) the start-up line says where steps are reduced.
err=$(env -u PARAMSYNC_RING timeout 3 "$daemon" --listen 127.0.0.1:0 --metrics-addr off \
  --reduce-device cuda 2>&1 >/dev/null)
rc=$?
if [ $rc = 2 ] && [[ "$err" == *"--reduce-device cuda, but no CUDA device can be used"* ]]; then
  echo "ok: --reduce-device cuda without a device -> $err"
elif [ $rc = 124 ] && [[ "$err" == *"reduce on cuda ("* ]]; then
  echo "ok: --reduce-device cuda with a device: reduces every step there"
else
  fail "--reduce-device cuda: exit $rc, '$err'"
fi
err=$(env -u PARAMSYNC_RING timeout 3 "$daemon" --listen 127.0.0.1:0 --metrics-addr off \
  --reduce-device auto 2>&1 >/dev/null)
rc=$?
if [ $rc = 124 ] && [[ "$err" == *"reduce on cpu ("* || "$err" == *"reduce on cuda from 1M per input, cpu below ("* ]]; then
  echo "ok: --reduce-device auto -> $(grep -o 'reduce on [^(]*' <<<"$err")"
else
  fail "--reduce-device auto: exit $rc, '$err'"
fi

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
