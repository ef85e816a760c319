#!/usr/bin/env bash
# hosts.sh: N "hosts" as network namespaces on this machine, for multi-host tests.
#
# Every host is a namespace with lo and eth0 (a veth) at 10.77.0.(i+1)/24 by
# default; the peers of the veths sit on a bridge inside one more namespace
# (the "switch"), so nothing is added to the caller's namespace and parallel
# runs (unique names per run) do not see each other. Needs root (ip netns).
#
#   eval "$(hosts.sh up N)"        make h0..h(N-1); prints `export PS_NETNS=DIR`
#   hosts.sh run N [--paramsyncd BIN [DAEMON_ARGS]] -- CMD [ARGS]
#                                  up, (start paramsyncd), run CMD with PS_NETNS
#                                  exported, down afterwards, also on failure or
#                                  a signal; exits with CMD's status
#   hosts.sh paramsyncd BIN [DAEMON_ARGS]
#                                  coordinator on h0 (ADDR:29400) and one agent per
#                                  host (ADDR:29500); waits until all serve
#   hosts.sh exec HOST CMD [ARGS]  run CMD in HOST (h0, h1, ... or 0, 1, ...)
#   hosts.sh spawn HOST NAME CMD   start CMD in HOST in the background; log in
#                                  $PS_NETNS/NAME.log, pid in $PS_NETNS/NAME.pid
#   hosts.sh stop NAME [SIGNAL]    signal a spawned process (default TERM) and wait
#   hosts.sh pid NAME              pid of a spawned process ("agent-h1", "coordinator")
#   hosts.sh link HOST down|up     take HOST's eth0 down or up (a cable pulled)
#   hosts.sh addr HOST             HOST's IPv4 address
#   hosts.sh agent HOST            HOST's agent address (ADDR:29500)
#   hosts.sh coordinator           the coordinator's address
#   hosts.sh ns HOST               HOST's namespace name (for ip -n, ip netns exec)
#   hosts.sh hosts                 the host names, one a line
#   hosts.sh check                 exit 0 if namespaces can be made here; else print
#                                  why and exit 77
#   hosts.sh down                  stop every process in the hosts, delete them
#
# Commands other than up, run and check find the hosts through $PS_NETNS (or
# -s DIR before the command). Inside a host, eth0 is the only link besides lo:
# `exec HOST tc qdisc add dev eth0 root netem loss 10%` or
# `exec HOST iptables -A INPUT -p tcp --dport 29500 -j DROP` affect that host
# alone. Environment: PS_NETNS_SUBNET (default 10.77.0, a /24 prefix),
# PS_NETNS_MTU (default 1500), PS_NETNS_CC (the hosts' TCP congestion
# control, e.g. reno; default: what a new namespace gets, the machine's),
# PS_NETNS_RATE (each host's link limited to this rate each way, a tc rate
# such as 1gbit, as a NIC of that speed would be; default: no limit, so the
# hosts share the machine's cores and no link is ever the bottleneck),
# PS_NETNS_MACHINES=1 (`paramsyncd` gives each host's agent --machine-id HOST,
# as agents on machines of their own would have; default: they share this
# machine's boot id, which --ring auto takes for shared cores).
set -euo pipefail

prog=$(basename "$0")
die() {
    echo "$prog: $*" >&2
    exit 1
}

COORD_PORT=29400
AGENT_PORT=29500

state=${PS_NETNS:-}
if [ "${1:-}" = "-s" ]; then
    state=$2
    shift 2
fi

need_state() {
    [ -n "$state" ] && [ -f "$state/hosts" ] || die "no hosts: set PS_NETNS (from '$prog up N') or use -s DIR"
}

# host name -> its line "name ns addr" in $state/hosts
host_line() {
    local h=$1
    [[ $h =~ ^[0-9]+$ ]] && h="h$h"
    awk -v h="$h" '$1 == h { print; found = 1 } END { exit !found }' "$state/hosts" ||
        die "no host '$1' (hosts: $(awk '{printf "%s ", $1}' "$state/hosts"))"
}
host_ns() { host_line "$1" | awk '{print $2}'; }
host_addr() { host_line "$1" | awk '{print $3}'; }

cmd_check() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "network namespaces need root (uid $(id -u))"
        exit 77
    fi
    command -v ip >/dev/null || {
        echo "ip (iproute2) is not installed"
        exit 77
    }
    local probe="psprobe-$$-$RANDOM" err
    if ! err=$(ip netns add "$probe" 2>&1); then
        echo "ip netns add is not permitted here: $err"
        exit 77
    fi
    if ! err=$(ip -n "$probe" link add vprobe0 type veth peer name vprobe1 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        echo "veth pairs cannot be made here: $err"
        exit 77
    fi
    if ! err=$(ip -n "$probe" link add brprobe type bridge 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        echo "bridges cannot be made here: $err"
        exit 77
    fi
    ip netns del "$probe"
    exit 0
}

# Deletes everything of the run in $state; safe to call twice or on a half-made run.
cmd_down() {
    [ -n "$state" ] && [ -d "$state" ] || return 0
    trap '' INT TERM # a second signal must not leave half the run behind
    local id ns pid pids f
    id=$(cat "$state/id" 2>/dev/null || true)
    # Spawned processes first (TERM, then KILL after 3 s), then whatever else runs in the hosts.
    for f in "$state"/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        kill -TERM "$pid" 2>/dev/null || true
    done
    for ns in $(cat "$state/namespaces" 2>/dev/null); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
    done
    for _ in $(seq 30); do
        local alive=0
        for ns in $(cat "$state/namespaces" 2>/dev/null); do
            [ -n "$(ip netns pids "$ns" 2>/dev/null || true)" ] && alive=1
        done
        [ $alive -eq 0 ] && break
        sleep 0.1
    done
    for ns in $(cat "$state/namespaces" 2>/dev/null); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    done
    for ns in $(cat "$state/namespaces" 2>/dev/null); do
        ip netns del "$ns" 2>/dev/null || true
    done
    # veths left in this namespace by an interrupted `up`
    if [ -n "$id" ]; then
        for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
            grep "^p${id}" || true); do
            ip link del "$l" 2>/dev/null || true
        done
    fi
    if [ "${PS_NETNS_KEEP_STATE:-0}" != 1 ]; then
        rm -rf "$state"
    fi
}

# Deletes the runs made by `run` whose process is gone (killed with SIGKILL,
# e.g. by a ctest timeout, so that it could not clean up).
reap_stale() {
    local d owner
    for d in "${TMPDIR:-/tmp}"/ps-netns-*; do
        [ -f "$d/owner" ] || continue
        owner=$(cat "$d/owner" 2>/dev/null || true)
        [ -n "$owner" ] && ! kill -0 "$owner" 2>/dev/null || continue
        echo "$prog: deleting the hosts of a run whose process $owner is gone ($d)" >&2
        (state=$d cmd_down) || true
    done
}

cmd_up() {
    local n=${1:-}
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || die "up N: N from 1 to 250"
    local why
    why=$( (cmd_check) 2>&1) || {
        echo "$prog: $why" >&2
        exit 77
    }
    reap_stale
    local subnet=${PS_NETNS_SUBNET:-10.77.0} mtu=${PS_NETNS_MTU:-1500}
    local id
    id=$(printf '%04x%04x' $(($$ & 0xffff)) $((RANDOM)))
    state=$(mktemp -d "${TMPDIR:-/tmp}/ps-netns-$id.XXXX")
    echo "$id" >"$state/id"
    : >"$state/hosts"
    : >"$state/namespaces"
    # Anything failing from here on (set -e, die, a signal) deletes what was made.
    trap 'cmd_down' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    local sw="ps-$id-sw"
    ip netns add "$sw"
    echo "$sw" >>"$state/namespaces"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    local i
    for ((i = 0; i < n; i++)); do
        local ns="ps-$id-h$i" a="p${id}a$i" b="p${id}b$i"
        ip netns add "$ns"
        echo "$ns" >>"$state/namespaces"
        ip link add "$a" mtu "$mtu" type veth peer name "$b" mtu "$mtu"
        ip link set "$a" netns "$ns"
        ip link set "$b" netns "$sw"
        ip -n "$ns" link set "$a" name eth0
        ip -n "$sw" link set "$b" name "h$i"
        ip -n "$sw" link set "h$i" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [ -n "${PS_NETNS_RATE:-}" ]; then
            # Both ways: the host's egress, and the switch's towards it.
            local q qns qdev
            for q in "$ns eth0" "$sw h$i"; do
                read -r qns qdev <<<"$q"
                ip netns exec "$qns" tc qdisc add dev "$qdev" root tbf rate "$PS_NETNS_RATE" \
                    burst 256kb latency 100ms ||
                    die "cannot limit $qdev in $qns to $PS_NETNS_RATE (PS_NETNS_RATE)"
            done
        fi
        if [ -n "${PS_NETNS_CC:-}" ]; then
            ip netns exec "$ns" sysctl -qw net.ipv4.tcp_congestion_control="$PS_NETNS_CC" ||
                die "cannot set TCP congestion control $PS_NETNS_CC (PS_NETNS_CC) in $ns"
        fi
        echo "h$i $ns $subnet.$((i + 1))" >>"$state/hosts"
    done
    # Wait until every host reaches h0 (the bridge forwards once its ports are up).
    for ((i = 1; i < n; i++)); do
        local ok=0
        for _ in $(seq 50); do
            # a refused connection proves the path works (no ping needed)
            local probe
            probe=$(ip netns exec "ps-$id-h$i" timeout 1 bash -c "exec 3<>/dev/tcp/$subnet.1/9" 2>&1 ||
                true)
            if [[ $probe == *refused* ]]; then
                ok=1
                break
            fi
            sleep 0.1
        done
        [ $ok -eq 1 ] || die "h$i cannot reach h0 at $subnet.1"
    done
    trap - EXIT INT TERM
    echo "export PS_NETNS=$state"
}

cmd_exec() {
    need_state
    local ns
    ns=$(host_ns "$1")
    shift
    [ $# -gt 0 ] || die "exec HOST CMD"
    exec ip netns exec "$ns" "$@"
}

cmd_spawn() {
    need_state
    [ $# -ge 3 ] || die "spawn HOST NAME CMD [ARGS]"
    local ns name=$2
    ns=$(host_ns "$1")
    shift 2
    [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || die "spawn: NAME may hold letters, digits, _ . -"
    ip netns exec "$ns" "$@" >"$state/$name.log" 2>&1 </dev/null &
    echo $! >"$state/$name.pid"
}

# Whether process PID runs: a zombie (ended, not yet reaped; this machine's
# init reaps the orphans of spawn only every second or two) counts as gone.
alive() {
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    [ "${st%% *}" != Z ]
}

cmd_stop() {
    need_state
    local f="$state/$1.pid" sig=${2:-TERM}
    [ -f "$f" ] || die "no spawned process '$1'"
    local pid
    pid=$(cat "$f")
    kill -"$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_pid() {
    need_state
    [ -f "$state/$1.pid" ] || die "no spawned process '$1'"
    cat "$state/$1.pid"
}

cmd_link() {
    need_state
    local ns
    ns=$(host_ns "$1")
    case "${2:-}" in
    up | down) ip -n "$ns" link set eth0 "$2" ;;
    *) die "link HOST down|up" ;;
    esac
}

# Waits until spawned NAME writes its announce file; fails if it exits first.
wait_serving() {
    local name=$1 file=$2 pid
    pid=$(cat "$state/$name.pid")
    for _ in $(seq 300); do
        [ -s "$file" ] && return 0
        if ! alive "$pid"; then
            echo "$prog: $name exited before serving; its log:" >&2
            cat "$state/$name.log" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "$prog: $name is not serving after 30 s; its log:" >&2
    cat "$state/$name.log" >&2
    return 1
}

cmd_paramsyncd() {
    need_state
    local bin=${1:-}
    [ -x "$bin" ] || die "paramsyncd BIN: '$bin' is not an executable"
    shift
    local caddr h addr
    caddr="$(host_addr h0):$COORD_PORT"
    cmd_spawn h0 coordinator "$bin" --role coordinator --listen "$caddr" \
        --announce-file "$state/coordinator.addr" "$@"
    wait_serving coordinator "$state/coordinator.addr"
    local machine=()
    for h in $(awk '{print $1}' "$state/hosts"); do
        addr="$(host_addr "$h"):$AGENT_PORT"
        [ "${PS_NETNS_MACHINES:-0}" = 1 ] && machine=(--machine-id "$h")
        cmd_spawn "$h" "agent-$h" "$bin" --role agent --listen "$addr" --advertise "$addr" \
            --coordinator "$caddr" --announce-file "$state/agent-$h.addr" "${machine[@]}" "$@"
    done
    for h in $(awk '{print $1}' "$state/hosts"); do
        wait_serving "agent-$h" "$state/agent-$h.addr"
    done
}

cmd_run() {
    local n=${1:-} bin="" dargs=()
    shift || true
    if [ "${1:-}" = "--paramsyncd" ]; then
        bin=$2
        shift 2
        # daemon args up to the command's "--"
        while [ $# -gt 0 ] && [ "$1" != "--" ]; do
            dargs+=("$1")
            shift
        done
    fi
    [ "${1:-}" = "--" ] || die "run N [--paramsyncd BIN [DAEMON_ARGS]] -- CMD [ARGS]"
    shift
    [ $# -gt 0 ] || die "run: no command"
    local out
    out=$(cmd_up "$n") || exit $?
    state=${out#export PS_NETNS=}
    export PS_NETNS=$state
    echo $$ >"$state/owner" # a later `up` deletes the run if this process was SIGKILLed
    trap 'cmd_down' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    if [ -n "$bin" ]; then
        cmd_paramsyncd "$bin" "${dargs[@]}"
    fi
    # In the background, so that a signal is handled at once (bash runs traps
    # only between foreground commands); stdin stays the caller's.
    local rc=0 child
    "$@" <&0 &
    child=$!
    trap 'kill -TERM $child 2>/dev/null; exit 130' INT
    trap 'kill -TERM $child 2>/dev/null; exit 143' TERM
    wait $child || rc=$?
    exit $rc
}

cmd=${1:-}
[ -n "$cmd" ] || {
    sed -n '2,37p' "$0"
    exit 2
}
shift
case "$cmd" in
up) cmd_up "$@" ;;
down)
    need_state
    cmd_down
    ;;
run) cmd_run "$@" ;;
check) cmd_check ;;
exec) cmd_exec "$@" ;;
spawn) cmd_spawn "$@" ;;
stop) cmd_stop "$@" ;;
pid) cmd_pid "$@" ;;
link) cmd_link "$@" ;;
paramsyncd) cmd_paramsyncd "$@" ;;
addr)
    need_state
    host_addr "$1"
    ;;
agent)
    need_state
    echo "$(host_addr "$1"):$AGENT_PORT"
    ;;
coordinator)
    need_state
    echo "$(host_addr h0):$COORD_PORT"
    ;;
ns)
    need_state
    host_ns "$1"
    ;;
hosts)
    need_state
    awk '{print $1}' "$state/hosts"
    ;;
-h | --help | help) sed -n '2,37p' "$0" ;;
*) die "unknown command '$cmd' (see $prog --help)" ;;
esac
