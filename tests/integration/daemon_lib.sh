# shellcheck shell=bash
# Sourced by the integration scripts that run a paramsyncd of their own (bench_inflight.sh,
# fake_gpu.sh): a work folder removed at exit with the daemon stopped, fail (printing the
# folder's logs), and start_daemon.

# daemon_lib_init NAME: a work folder /tmp/ps-NAME.XXXXXX in $work, cleaned up at exit.
daemon_lib_init() {
  work=$(mktemp -d "/tmp/ps-$1.XXXXXX")
  dpid=
  trap daemon_lib_cleanup EXIT
}

daemon_lib_cleanup() {
  [ -n "$dpid" ] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null
  rm -rf "$work"
}

# fail MESSAGE: prints it and the tail of every log and report in the work folder; exits 1.
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log "$work"/report; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done
  exit 1
}

# start_daemon [VAR=VALUE...] -- DAEMON ARGS...: starts DAEMON listening on a free port of
# 127.0.0.1 with ARGS and the VARs in its environment, its output in $work/daemon.log; sets
# dpid and addr once it has announced its address.
start_daemon() {
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local bin=$1
  shift
  rm -f "$work/addr"
  env "${envs[@]}" "$bin" --listen 127.0.0.1:0 --announce-file "$work/addr" "$@" \
    > "$work/daemon.log" 2>&1 &
  dpid=$!
  for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
  [ -s "$work/addr" ] || fail "$(basename "$bin") did not announce its address"
  # shellcheck disable=SC2034 # read by the scripts that source this
  addr=$(cat "$work/addr")
}
