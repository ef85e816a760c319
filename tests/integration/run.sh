#!/usr/bin/env bash
# Runs one integration scenario with real processes: paramsyncd (embedded, or a coordinator and
# two or more agents) and N worker processes per job; checks every exit status, the outputs of examples
# against their expected text, and that every daemon exits 0 on SIGTERM.
#
# usage: run.sh --daemon PATH (--worker PATH --scenario NAME | --example PATH [--arg A]... --expect FILE)
#               [--np N] [--jobs K] [--topology embedded|split [--agents A] [--agent-machines]
#               [--placement blocks]]
#               [--init env|tcp|unix|file]
#               [--daemon-arg ARG]... [--agent-arg K ARG]... [--env NAME=VALUE]...
#               [--sigterm-after SECONDS]
#               [--then SCENARIO:NP] [--timeout SECONDS] [--metric 'SERIES>N' | 'SERIES=0' | 'SERIES<N']...
#               [--settle SECONDS]
#               [--private-shm SIZE]
# --agents: with --topology split, A agents (default 2); rank r joins through agent r mod A, or
# with --placement blocks through agent r / ceil(N / A) (ranks 0, 1 on the first, 2, 3 on the
# next, ...: the order of rank blocks round a ring then differs from rank order).
# --agent-arg K ARG: with --topology split, ARG for agent K alone (1..A, as agentK in the logs),
# after the --daemon-arg ones (a flag given again there wins).
# --agent-machines: with --topology split, each agent says it is on a machine of its own
# (--machine-id machine-A); otherwise they share this one's boot id.
# --private-shm: daemons and workers share a /dev/shm of SIZE of their own (a mount namespace;
# skipped where one cannot be made).
# --metric: after the scenario, SERIES (a metric with its labels, exactly as exposed) summed over
# every daemon must be above N (>0: above zero), or zero (for zero, a series that is not there
# counts when its family is: counters at zero are left out), or below N.
# --settle: the metrics are read that many seconds after the scenario's workers exit (what the
# daemons do once idle).
# Exit status: 0 passed, 1 failed, 77 skipped (every worker said so). PS_IT_KEEP=1 keeps the logs.
# PS_IT_DAEMON_ARGS: words added to every daemon's command line (e.g. '--reduce-device cuda', as
# scripts/gpu-run runs the whole suite on a GPU host).
set -u

daemon= worker= scenario= example= expect= np=2 jobs=1 topology=embedded init=env nagents=2
sigterm_after= then= timeout=150 agent_machines= placement=round settle=
daemon_args=() agent_args=() example_args=() extra_env=() metric_checks=()
orig_args=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    --daemon) daemon=$2; shift ;;
    --worker) worker=$2; shift ;;
    --scenario) scenario=$2; shift ;;
    --example) example=$2; shift ;;
    --arg) example_args+=("$2"); shift ;;
    --expect) expect=$2; shift ;;
    --np) np=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    --topology) topology=$2; shift ;;
    --agents) nagents=$2; shift ;;
    --agent-machines) agent_machines=1 ;;
    --placement) placement=$2; shift ;;
    --init) init=$2; shift ;;
    --daemon-arg) daemon_args+=("$2"); shift ;;
    --agent-arg) agent_args+=("$2" "$3"); shift 2 ;;
    --env) extra_env+=("$2"); shift ;;
    --sigterm-after) sigterm_after=$2; shift ;;
    --then) then=$2; shift ;;
    --timeout) timeout=$2; shift ;;
    --metric) metric_checks+=("$2"); shift ;;
    --settle) settle=$2; shift ;;
    --private-shm)
      # Again, inside a mount namespace with a small tmpfs on /dev/shm.
      if [ -z "${PS_IT_IN_NS:-}" ]; then
        if ! unshare -m --propagation private true 2>/dev/null; then
          echo "run.sh: SKIPPED: cannot make a mount namespace here (unshare -m needs root)" >&2
          exit 77
        fi
        exec env PS_IT_IN_NS=1 unshare -m --propagation private \
          sh -c 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"' "$2" "$0" "${orig_args[@]}"
      fi
      shift ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -x "$daemon" ] || { echo "run.sh: no paramsyncd at '$daemon'" >&2; exit 1; }
case "$placement" in round | blocks) ;; *)
  echo "run.sh: --placement $placement: round (the default) or blocks" >&2; exit 2 ;;
esac
# An --agent-arg no agent would take is a mistake in the test, not a flag to drop.
for ((i = 0; i < ${#agent_args[@]}; i += 2)); do
  k=${agent_args[i]}
  if [ "$topology" != split ] || ! [[ "$k" =~ ^[0-9]+$ ]] || [ "$k" -lt 1 ] || [ "$k" -gt "$nagents" ]; then
    echo "run.sh: --agent-arg $k: no such agent (--topology split, agents 1 to $nagents)" >&2
    exit 2
  fi
done
name=${scenario:-$(basename "${example:-?}")}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ps-it.XXXXXX") || exit 1
daemon_pids=() daemon_names=() worker_pids=() worker_logs=()
status=0

say() { printf 'run.sh: %s\n' "$*" >&2; }
failed() { say "FAIL: $*"; status=1; }

dump_logs() {
  for f in "$tmp"/*.log; do
    [ -f "$f" ] || continue
    echo "----- $(basename "$f") (last 40 lines)" >&2
    tail -n 40 "$f" >&2
  done
}

cleanup() {
  local pid
  for pid in "${worker_pids[@]}" "${daemon_pids[@]}"; do
    kill -KILL "$pid" 2>/dev/null
  done
  wait 2>/dev/null
  if [ -n "${PS_IT_KEEP:-}" ]; then say "logs kept in $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# The daemon reads PARAMSYNC_* too: start it from a clean slate.
clean_env=(env)
for v in $(compgen -e); do
  case "$v" in PARAMSYNC_*) clean_env+=(-u "$v") ;; esac
done

# start_daemon NAME ARGS...: starts paramsyncd, leaves its pid in daemon_pids. Metrics go to a
# port of their own, so that tests running side by side do not contend for the default one.
start_daemon() {
  local dname=$1; shift
  # shellcheck disable=SC2086 # PS_IT_DAEMON_ARGS is split into words on purpose
  "${clean_env[@]}" "$daemon" --metrics-addr 127.0.0.1:0 ${PS_IT_DAEMON_ARGS:-} "$@" 2>"$tmp/$dname.log" &
  daemon_pids+=($!)
  daemon_names+=("$dname")
}

# wait_listening NAME: prints the address the daemon NAME listens on (waits up to 15 s).
wait_listening() {
  local dname=$1 i addr
  for i in $(seq 150); do
    addr=$(sed -n 's/^paramsyncd: listening on \([^ ]*\).*/\1/p' "$tmp/$dname.log" | head -n 1)
    if [ -n "$addr" ]; then
      echo "$addr"
      return 0
    fi
    sleep 0.1
  done
  failed "$dname did not report 'paramsyncd: listening on ADDR' within 15 s"
  return 1
}

# Daemons.
agent_addrs=()
announce="$tmp/announce"
if [ "$topology" = split ]; then
  start_daemon coordinator --role coordinator --listen 127.0.0.1:0 "${daemon_args[@]}"
  coord=$(wait_listening coordinator) || { dump_logs; exit 1; }
  for a in $(seq "$nagents"); do
    machine=() own=()
    [ -n "$agent_machines" ] && machine=(--machine-id "machine-$a")
    for ((i = 0; i < ${#agent_args[@]}; i += 2)); do
      [ "${agent_args[i]}" = "$a" ] && own+=("${agent_args[i + 1]}")
    done
    start_daemon agent$a --role agent --coordinator "$coord" --listen 127.0.0.1:0 \
      "${machine[@]}" "${daemon_args[@]}" "${own[@]}"
    agent_addrs+=("$(wait_listening agent$a)") || { dump_logs; exit 1; }
  done
else
  listen=127.0.0.1:0
  [ "$init" = unix ] && listen="unix:$tmp/paramsyncd.sock"
  extra=()
  [ "$init" = file ] && extra=(--announce-file "$announce")
  if [ "$init" != file ]; then
    start_daemon paramsyncd --listen "$listen" "${extra[@]}" "${daemon_args[@]}"
    agent_addrs+=("$(wait_listening paramsyncd)") || { dump_logs; exit 1; }
  fi
fi

# start_workers SCENARIO NP JOBS TAG: N workers per job, each job on its own id and salt.
start_workers() {
  local sc=$1 n=$2 k=$3 tag=$4 j r addr job log wenv na
  mkdir -p "$tmp/workers"
  for j in $(seq 0 $((k - 1))); do
    job="$tag-$name-$j-$$"
    for r in $(seq 0 $((n - 1))); do
      addr=
      if [ ${#agent_addrs[@]} -gt 0 ]; then
        na=${#agent_addrs[@]}
        if [ "$placement" = blocks ]; then
          addr=${agent_addrs[$((r / ((n + na - 1) / na)))]}
        else
          addr=${agent_addrs[$((r % na))]}
        fi
      fi
      log="$tmp/workers/$tag-job$j-rank$r"
      # Each init method finds the agent its own way; the others' variables are unset.
      case "$init" in
        env) wenv=(PARAMSYNC_ADDR="$addr" PARAMSYNC_JOB="$job") ;;
        tcp) wenv=(-u PARAMSYNC_ADDR -u PARAMSYNC_JOB PS_TEST_INIT="tcp://$addr?job=$job") ;;
        unix) wenv=(-u PARAMSYNC_ADDR PARAMSYNC_JOB="$job" PS_TEST_INIT="$addr") ;;
        file) wenv=(-u PARAMSYNC_ADDR -u PARAMSYNC_JOB PS_TEST_INIT="file://$announce") ;;
        *) echo "run.sh: unknown init method $init" >&2; exit 2 ;;
      esac
      wenv+=(WORLD_SIZE="$n" RANK="$r" PS_TEST_SALT="$j" PARAMSYNC_TIMEOUT_MS=60000
             PARAMSYNC_JOIN_TIMEOUT_MS=30000 "${extra_env[@]}")
      if [ -n "$example" ]; then
        env "${wenv[@]}" "$example" "${example_args[@]}" >"$log.out" 2>"$log.log" &
      else
        env "${wenv[@]}" "$worker" "$sc" >"$log.out" 2>"$log.log" &
      fi
      worker_pids+=($!)
      worker_logs+=("$log")
    done
  done
}

# wait_workers: waits for every worker (kills them at the deadline); sets status.
wait_workers() {
  local deadline=$((SECONDS + timeout)) i pid rc skipped=0 passed=0
  for i in "${!worker_pids[@]}"; do
    pid=${worker_pids[$i]}
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      failed "$(basename "${worker_logs[$i]}") still running after ${timeout}s: killed"
      kill -KILL "$pid" 2>/dev/null
    fi
    wait "$pid"
    rc=$?
    case $rc in
      0) passed=$((passed + 1)) ;;
      77) skipped=$((skipped + 1)) ;;
      *) failed "$(basename "${worker_logs[$i]}") exited with status $rc" ;;
    esac
  done
  worker_pids=()
  if [ $status -eq 0 ] && [ $skipped -gt 0 ] && [ $passed -eq 0 ]; then
    status=77
  fi
}

start_workers "$scenario" "$np" "$jobs" main
if [ "$init" = file ]; then
  # Workers are waiting for the announce file: the daemon comes up after them.
  sleep 1
  start_daemon paramsyncd --listen 127.0.0.1:0 --announce-file "$announce" "${daemon_args[@]}"
  wait_listening paramsyncd >/dev/null || { dump_logs; exit 1; }
fi
if [ -n "$sigterm_after" ]; then
  sleep "$sigterm_after"
  for pid in "${daemon_pids[@]}"; do kill -TERM "$pid"; done
fi
wait_workers

if [ -n "$expect" ] && [ $status -eq 0 ]; then
  for log in "${worker_logs[@]}"; do cat "$log.out"; done >"$tmp/output.txt"
  if ! diff -u "$expect" "$tmp/output.txt" >"$tmp/diff.txt"; then
    failed "output differs from $(basename "$expect"):"
    cat "$tmp/diff.txt" >&2
  fi
fi

# scrape NAME: prints the /metrics text of the daemon NAME (plain HTTP over bash's /dev/tcp).
scrape() {
  local hp
  hp=$(sed -n 's|^paramsyncd: metrics on http://\([^/]*\)/metrics.*|\1|p' "$tmp/$1.log" | head -n 1)
  [ -n "$hp" ] || return 1
  exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}" || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$hp" >&3
  cat <&3
  exec 3<&-
}

if [ ${#metric_checks[@]} -gt 0 ] && [ $status -eq 0 ]; then
  [ -n "$settle" ] && sleep "$settle"
  for dname in "${daemon_names[@]}"; do
    scrape "$dname" >"$tmp/$dname.metrics" || failed "could not read the metrics of $dname"
  done
  for check in "${metric_checks[@]}"; do
    series=${check%[=><]*} want=${check#"$series"}
    # A series no daemon exposes (a misspelt name) would read as 0: refused,
    # except for =0 when its family is exposed (counters at 0 are left out).
    family=${series%%\{*}
    if ! cat "$tmp"/*.metrics | awk -v s="$series" 'index($0, s " ") == 1 { f = 1 } END { exit !f }' &&
      ! { [ "$want" = '=0' ] && grep -qx "# TYPE $family [a-z]*" "$tmp"/*.metrics; }; then
      failed "metric $series: no daemon exposes it"
      continue
    fi
    total=$(cat "$tmp"/*.metrics | awk -v s="$series" 'index($0, s " ") == 1 { t += $NF } END { print t + 0 }')
    case "$want" in
      '>0') [ "$total" != 0 ] || failed "metric $series is $total, expected more than 0" ;;
      '=0') [ "$total" = 0 ] || failed "metric $series is $total, expected 0" ;;
      '>'[0-9]*) [ "$total" -gt "${want#>}" ] || failed "metric $series is $total, expected above ${want#>}" ;;
      '<'[0-9]*) [ "$total" -lt "${want#<}" ] || failed "metric $series is $total, expected below ${want#<}" ;;
      *) echo "run.sh: --metric wants SERIES>N, SERIES=0 or SERIES<N, not '$check'" >&2; exit 2 ;;
    esac
    say "metric $series = $total (wanted $want)"
  done
fi

# The daemon keeps serving after whatever the scenario did.
if [ -n "$then" ] && [ -z "$sigterm_after" ]; then
  main_status=$status
  status=0
  worker_logs_main=("${worker_logs[@]}")
  worker_logs=()
  start_workers "${then%%:*}" "${then##*:}" 1 then
  wait_workers
  [ $status -ne 0 ] && failed "the daemon did not serve a job after the scenario"
  [ $main_status -ne 0 ] && status=$main_status
  worker_logs=("${worker_logs_main[@]}" "${worker_logs[@]}")
fi

# Every daemon stops cleanly: SIGTERM (agents before the coordinator), exit status 0.
for ((i = ${#daemon_pids[@]} - 1; i >= 0; i--)); do
  pid=${daemon_pids[$i]}
  dname=${daemon_names[$i]}
  if kill -0 "$pid" 2>/dev/null; then
    [ -z "$sigterm_after" ] && kill -TERM "$pid"
  fi
  deadline=$((SECONDS + 20))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    failed "$dname did not exit within 20 s of SIGTERM"
    kill -KILL "$pid" 2>/dev/null
  fi
  wait "$pid"
  rc=$?
  [ $rc -eq 0 ] || failed "$dname exited with status $rc after SIGTERM"
done
daemon_pids=()

if [ $status -eq 1 ]; then
  for log in "${worker_logs[@]}"; do
    for f in "$log.log" "$log.out"; do
      [ -s "$f" ] || continue
      echo "----- $(basename "$f") (last 30 lines)" >&2
      tail -n 30 "$f" >&2
    done
  done
  dump_logs
  say "$name: FAILED"
elif [ $status -eq 77 ]; then
  say "$name: SKIPPED"
else
  # A check a worker skipped within a passing scenario (a kernel without
  # something it needs, say) says so here too.
  for log in "${worker_logs[@]}"; do
    grep -h "SKIPPED" "$log.log" "$log.out" 2>/dev/null
  done | sort -u >&2
  say "$name: passed"
fi
exit $status
