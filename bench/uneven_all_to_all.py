#!/usr/bin/python3
"""all_to_all_single with split sizes: torch's Gloo against paramsync, side by side.

    /usr/bin/python3 bench/uneven_all_to_all.py --paramsyncd BUILD/server/paramsyncd \
        --python VENV/bin/python [--np 4] [--mib 1] [--iters 10] [--rounds 2] \
        [--memory empty] [--agents 2 | --netns 4]

Rank r sends rank j (r + j + 1) x --mib MiB of float32 rows ("uneven": the
largest block is (2 np - 1) / np times the mean), then every block --np + 1
times --mib MiB ("even", still with split sizes given), and the even case
without split sizes ("no-splits", paramsync's single collective). Each case
runs --rounds times alternately on Gloo (torch.distributed, init by a
file://) and on paramsync (one paramsyncd per run), and prints the milliseconds a
call of rank 0 (the mean of --iters after two untimed calls) and paramsync's
time over Gloo's. Every run checks its result once. --python: an interpreter
with paramsync and torch (the client tests' venv: build/tests/clients/venv).
--memory empty: paramsync's tensors from paramsync's empty() (Gloo's as ever).
--agents A: paramsync as a coordinator and A agents on loopback, rank r through
agent r mod A (ranks on several agents: no peer copies), instead of one paramsyncd.
--netns N: N network-namespace hosts (tests/netns/hosts.sh, needs root), rank r on
host r mod N, for both systems: Gloo over the hosts' links, paramsync with a
coordinator on the first host and an agent on each.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

CASES = ("uneven", "even", "no-splits")
HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "netns",
                     "hosts.sh")


def hosts(*args):
    """tests/netns/hosts.sh's output for args."""
    return subprocess.check_output([HOSTS, *args], text=True).strip()


def worker(backend, case, memory, np_, mib, iters):
    import torch
    if backend == "gloo":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + os.environ["GLOO_FILE"],
                                world_size=np_, rank=int(os.environ["RANK"]))
    else:
        import paramsync.distributed as dist
        dist.init_process_group("paramsync")
    r, n = dist.get_rank(), dist.get_world_size()
    rows = mib * 256  # rows of 1024 float32: 4 KiB each
    if case == "uneven":
        ins = [(r + j + 1) * rows for j in range(n)]
        outs = [(j + r + 1) * rows for j in range(n)]
    else:
        ins = outs = [(n + 1) * rows] * n
    if memory == "empty" and backend == "paramsync":
        x = dist.empty((sum(ins), 1024), torch.float32).fill_(float(r))
        o = dist.empty((sum(outs), 1024), torch.float32)
    else:
        x = torch.full((sum(ins), 1024), float(r))
        o = torch.empty(sum(outs), 1024)
    splits = (None, None) if case == "no-splits" else (outs, ins)

    def call():
        dist.all_to_all_single(o, x, *splits)

    call()
    ok = all(bool((o[sum(outs[:j]):sum(outs[:j + 1])] == j).all()) for j in range(n))
    call()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    dt = (time.perf_counter() - t0) / iters
    if r == 0:
        print("%.3f %d %.1f" % (dt * 1e3, ok, x.numel() * 4 / 2**20), flush=True)
    dist.destroy_process_group()


def start_daemon(a, tmp, name, *args):
    """A paramsyncd with args; (process, its address)."""
    ann = os.path.join(tmp, name + ".addr")
    d = subprocess.Popen([a.paramsyncd, "--listen", "127.0.0.1:0", "--announce-file", ann,
                          "--metrics-addr", "off", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while not (os.path.exists(ann) and open(ann).read().endswith("\n")):
        if time.monotonic() > end or d.poll() is not None:
            d.kill()
            sys.exit("paramsyncd (%s) did not start" % name)
        time.sleep(0.02)
    return d, open(ann).read().strip()


def run(a, backend, case):
    """(ms a call, whether correct, MiB a rank sends) of one run."""
    daemons, addrs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, WORLD_SIZE=str(a.np), GLOO_FILE=os.path.join(tmp, "gloo"),
                   PARAMSYNC_JOB="uneven-%d" % os.getpid())
        if a.netns:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        try:
            if backend == "paramsync" and a.netns:
                subprocess.run([HOSTS, "paramsyncd", a.paramsyncd], check=True,
                               stdout=subprocess.DEVNULL)
                addrs = [hosts("agent", "h%d" % k) for k in range(a.netns)]
            elif backend == "paramsync" and a.agents:
                d, coord = start_daemon(a, tmp, "coordinator", "--role", "coordinator")
                daemons.append(d)
                for k in range(a.agents):
                    d, addr = start_daemon(a, tmp, "agent%d" % k, "--role", "agent",
                                           "--coordinator", coord)
                    daemons.append(d)
                    addrs.append(addr)
            elif backend == "paramsync":
                d, addr = start_daemon(a, tmp, "daemon")
                daemons.append(d)
                addrs.append(addr)
            on = (lambda r: [HOSTS, "exec", "h%d" % (r % a.netns)]) if a.netns else \
                (lambda r: [])
            procs = [subprocess.Popen(on(r) + [a.python, os.path.abspath(__file__), "--worker",
                                               backend, case, a.memory, str(a.np), str(a.mib),
                                               str(a.iters)],
                                      env=dict(env, RANK=str(r), **({"PARAMSYNC_ADDR": addrs[
                                          r % len(addrs)]} if addrs else {})),
                                      stdout=subprocess.PIPE, text=True) for r in range(a.np)]
            outs = [p.communicate(timeout=300)[0] for p in procs]
            if any(p.returncode for p in procs):
                sys.exit("%s %s: a rank failed" % (backend, case))
        finally:
            for d in daemons:
                d.terminate()
                d.wait()
            if backend == "paramsync" and a.netns:
                for k in range(a.netns):
                    subprocess.run([HOSTS, "stop", "agent-h%d" % k], check=False)
                subprocess.run([HOSTS, "stop", "coordinator"], check=False)
    ms, ok, mib = outs[0].split()
    return float(ms), ok == "1", float(mib)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], sys.argv[4], *(int(v) for v in sys.argv[5:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paramsyncd", required=True, help="the paramsyncd binary")
    p.add_argument("--python", required=True,
                   help="an interpreter with paramsync and torch (build/tests/clients/venv)")
    p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--mib", type=int, default=1,
                   help="MiB of the unit block: rank r sends rank j (r + j + 1) units")
    p.add_argument("--iters", type=int, default=10, help="timed calls a run (default 10)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each case on each system, alternately (default 2)")
    p.add_argument("--memory", choices=("tensor", "empty"), default="tensor",
                   help="where paramsync's tensors are: torch's, or paramsync's empty()")
    p.add_argument("--agents", type=int, default=0,
                   help="paramsync as a coordinator and this many agents on loopback, rank r "
                   "through agent r mod AGENTS (default 0: one paramsyncd)")
    p.add_argument("--netns", type=int, default=0,
                   help="this many network-namespace hosts (needs root), rank r on host r mod "
                   "NETNS, for both systems (default 0: this host)")
    a = p.parse_args()
    if a.netns and a.agents:
        p.error("--netns and --agents do not go together")
    if a.netns:
        up = subprocess.run([HOSTS, "up", str(a.netns)], capture_output=True, text=True)
        if up.returncode != 0:
            sys.exit("hosts.sh up: %s" % up.stderr.strip())
        os.environ["PS_NETNS"] = up.stdout.strip().split("=", 1)[1]
        try:
            return table(a)
        finally:
            subprocess.run([HOSTS, "down"], check=False, stdout=subprocess.DEVNULL)
    return table(a)


def table(a):
    print("%-10s %9s %10s %12s %8s" % ("case", "MiB/rank", "gloo ms", "paramsync ms", "ratio"))
    for case in CASES:
        for k in range(a.rounds):
            print("  %s, round %d of %d ..." % (case, k + 1, a.rounds), file=sys.stderr,
                  flush=True)
            g, gok, mib = run(a, "gloo", case)
            q, qok, _ = run(a, "paramsync", case)
            if not (gok and qok):
                sys.exit("%s: a result was wrong (gloo %s, paramsync %s)" % (case, gok, qok))
            print("%-10s %9.1f %10.2f %12.2f %7.2fx" % (case, mib, g, q, q / g), flush=True)


if __name__ == "__main__":
    main()
