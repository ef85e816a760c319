#!/usr/bin/python3
"""SIGTERM with calls in flight: the daemon exits 0, promptly, and every call in
flight (a collective waiting for a rank, a 64 MiB collective mid-transfer, the
Join streams) ends with UNAVAILABLE, and no rank is told of a lost one (not even
when another exits, its Join cut, the moment its own call fails).

Also an agent that does not host the job, with a worker's small collective on
its doorbell forwarded to the hub agent (the C client, through paramsync-bench):
that request has no server call the shutdown could cancel, so the drain must
end the forwarded call itself. The worker is told the agent is stopping ("shutting
down" in the call's status, or "stopping" if the doorbell closes first), not
that its peer was lost, and the agent exits promptly. The rank on the other
agent hears that rank 1 was lost because its agent is stopping, and the
coordinator lists that agent as stopping (`paramsync status`), not as
registered.

And the agent hosting the job stopping while a rank on another agent waits
there: that rank's call names the hub agent, and it hears that rank 0 was lost
because its agent is stopping (also with that rank a C rank whose barrier goes
over its doorbell and its agent's relay stream). And the coordinator alone
stopping: the workers' Joins end saying so.
"""
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

EXIT_S = 5.0  # the daemon must be gone this long after SIGTERM
BIG = 16 << 20
END = {"do": "wait_join_end", "s": 10}


def case(cl, binary, work, name, specs, started):
    d = cl.add(P.Daemon(binary, work, name, ["--liveness-timeout-ms", "2000"])).start()
    procs = P.spawn_job(cl, name, 2, d.addr, specs)
    started(procs)
    t = time.monotonic()
    rc = d.stop(timeout=EXIT_S + 3)
    dt = time.monotonic() - t
    P.log("%s: SIGTERM -> exit status %s after %.2fs" % (name, rc, dt))
    P.expect(rc == 0, "%s: paramsyncd exited %s on SIGTERM, want 0 within %.0fs; its log:\n%s"
             % (name, rc, EXIT_S, d.log_text()[-2000:]))
    P.expect(dt <= EXIT_S, "%s: paramsyncd took %.2fs to exit" % (name, dt))
    for p in procs:
        if p.spec["steps"][0]["do"] == "collective":
            ev = p.wait("coll", 10)
            P.expect(ev is not None and ev["code"] == "UNAVAILABLE" and
                     "shutting down" in ev["message"],
                     "%s: %s's collective in flight did not end with UNAVAILABLE 'shutting "
                     "down': %s" % (name, p.name, p.describe()))
        if p.spec["steps"][-1]["do"] == "collective":
            continue  # it exits once its collective ends, its Join cut without a Leave
        je = p.wait("join_end", 10)
        P.expect(je is not None and je["code"] == "UNAVAILABLE",
                 "%s: %s's Join stream did not end with UNAVAILABLE: %s" %
                 (name, p.name, p.describe()))
        # A rank that exits as soon as the drain fails its call is not "lost"
        # to the others: their Join ends first (ps__agent_drain).
        P.expect(not p.events("lost"), "%s: %s was told of a lost rank while paramsyncd "
                 "was stopping: %s" % (name, p.name, p.describe()))


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-sigterm-")
    with P.Cleanup() as cl:
        def waiting(procs):
            P.check(procs[0].wait("coll_start", 10) is not None, procs[0].describe())
            time.sleep(0.5)

        case(cl, binary, work, "waiting",
             {0: {"steps": [{"do": "collective", "kind": "BARRIER"}, END]},
              1: {"steps": [{"do": "sleep", "s": 60}]}}, waiting)

        # Rank 1 exits the moment its recv fails, its Join cut without a Leave.
        case(cl, binary, work, "exiting",
             {0: {"steps": [{"do": "collective", "kind": "BARRIER"}, END]},
              1: {"steps": [{"do": "collective", "kind": "RECV", "count": 4, "no_data": True}]}},
             waiting)

        def transferring(procs):
            P.check(procs[1].wait("sending", 30) is not None, procs[1].describe())
            time.sleep(0.2)

        big = {"do": "collective", "count": BIG, "raw": True}
        case(cl, binary, work, "transferring",
             {0: {"steps": [big, END]},
              1: {"steps": [dict(big, slow_s=0.05, announce_after=8 << 20), END]}},
             transferring)

        doorbell_forwarded(cl, binary, work)
        hub_stopping(cl, binary, work)
        hub_stopping_relayed(cl, binary, work)
        coordinator_stopping(cl, binary, work)
        many_stopping(cl, binary, work)
    P.done()


def waiting_at(daemon, job):
    """Whether daemon (an agent) has a collective of job in flight."""
    conn = P.Conn(daemon.addr)
    try:
        return len(conn.status(job).collectives) > 0
    except P.grpc.RpcError:
        return False
    finally:
        conn.close()


def bench_path(name):
    """paramsync-bench from --bench, or None after saying the case is SKIPPED."""
    if "--bench" not in sys.argv:
        P.log("%s: SKIPPED (no --bench PATH to paramsync-bench)" % name)
        return None
    return sys.argv[sys.argv.index("--bench") + 1]


def bench_rank1(bench, name, addr, out):
    """Rank 1 of job name, a C rank on shared memory through the agent at addr: one
    barrier (paramsync-bench), its output to out."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", PARAMSYNC_JOB=name, PARAMSYNC_ADDR=addr,
               PARAMSYNC_SHM="1")
    return subprocess.Popen([bench, "-t", "barrier", "-w", "1", "-n", "1"], env=env,
                            stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_at_hub(hub, name, r1=None):
    """Waits until rank 1's collective of job name waits at the hub agent (rank 1 a
    process r1 that must not have ended meanwhile, when given)."""
    end = time.monotonic() + 15
    while not waiting_at(hub, name):
        P.check(time.monotonic() < end and (r1 is None or r1.poll() is None),
                "%s: rank 1's collective never reached the hub (rank 1: %s)"
                % (name, r1.poll() if r1 else "a psworker"))
        time.sleep(0.1)


def expect_stopped_counts(name, coord):
    """The coordinator counted the one rank lost as stopped with its agent, which the
    rank-lost alert leaves out."""
    counts = dict(re.findall(r"^paramsync_ranks_(lost|stopped)_total (\d+)$", coord.metrics(),
                             re.M))
    P.expect(counts == {"lost": "0", "stopped": "1"},
             "%s: the coordinator counts ranks lost/stopped %s, want 0/1" % (name, counts))


def hub_stopping(cl, binary, work):
    """The agent hosting the job (rank 0's) stops, as in a rollout, while rank 1 on
    another agent waits in a barrier there: rank 1's call ends UNAVAILABLE naming the
    hub agent, and rank 1 hears that rank 0 was lost because its agent is stopping."""
    name = "hub-stopping"
    coord, (hub, other) = P.cluster(cl, binary, work, 2, common=["--liveness-timeout-ms", "2000"],
                                    tag="-" + name, metrics=True)
    P.wait_registered(P.Conn(coord.addr), [hub.addr, other.addr])
    procs = P.spawn_job(cl, name, 2, lambda r: hub.addr if r == 0 else other.addr,
                        {0: {"steps": [{"do": "sleep", "s": 60}]},
                         1: {"steps": [{"do": "collective", "kind": "BARRIER"}, END],
                             "hold_s": 60}})
    P.check(procs[1].wait("coll_start", 10) is not None, procs[1].describe())
    wait_at_hub(hub, name)
    rc = hub.stop(timeout=EXIT_S + 3)
    P.expect(rc == 0, "%s: the hub agent exited %s on SIGTERM" % (name, rc))
    ev = procs[1].wait("coll", 10)
    P.expect(ev is not None and ev["code"] == "UNAVAILABLE" and
             ("the agent hosting this job at %s is stopping: paramsyncd is shutting down" %
              hub.addr) in ev["message"],
             "%s: rank 1's barrier should end UNAVAILABLE naming the hub agent %s and its "
             "shutdown: %s" % (name, hub.addr, procs[1].describe()))
    lost = procs[1].wait("lost", 10)
    P.log("%s: rank 1's barrier: %s; then: %s" % (name, ev and ev["message"],
                                                 lost and lost["message"]))
    want = "rank 0 was lost: its agent at %s is stopping" % hub.addr
    P.expect(lost is not None and want in lost["message"],
             "%s: rank 1 should hear '%s': %s" % (name, want, procs[1].describe()))
    expect_stopped_counts(name, coord)


def hub_stopping_relayed(cl, binary, work):
    """As hub_stopping, with rank 1 a C rank on shared memory: its barrier goes from its
    doorbell over its agent's relay stream to the hub agent, and that path says the
    same."""
    name = "hub-stopping-relayed"
    bench = bench_path(name)
    if not bench:
        return
    coord, (hub, other) = P.cluster(cl, binary, work, 2, tag="-" + name)
    P.wait_registered(P.Conn(coord.addr), [hub.addr, other.addr])
    r0 = cl.add(P.WorkerProc({"addr": hub.addr, "job": name, "world": 2, "rank": 0,
                              "steps": [{"do": "sleep", "s": 60}]}))
    r1 = bench_rank1(bench, name, other.addr, subprocess.PIPE)
    try:
        P.check(r0.wait("ready", 30) is not None, r0.describe())
        wait_at_hub(hub, name, r1)
        rc = hub.stop(timeout=EXIT_S + 3)
        P.expect(rc == 0, "%s: the hub agent exited %s on SIGTERM" % (name, rc))
        out, _ = r1.communicate(timeout=15)
        P.log("%s: paramsync-bench exited %s: %s" % (name, r1.returncode, out.strip()[-300:]))
        # Its call's UNAVAILABLE, or the news that rank 0 was lost, whichever comes first:
        # either names the hub agent as stopping.
        want = ("the agent hosting this job at %s is stopping" % hub.addr,
                "rank 0 was lost: its agent at %s is stopping" % hub.addr)
        P.expect(r1.returncode == 1 and any(w in out for w in want),
                 "%s: rank 1's barrier should fail saying '%s' or '%s'; paramsync-bench "
                 "exited %s and said:\n%s" % ((name,) + want + (r1.returncode, out)))
    finally:
        if r1.poll() is None:
            r1.kill()
            r1.wait()


def coordinator_stopping(cl, binary, work):
    """The coordinator alone stops: the agent ends its workers' Joins saying so, and
    no rank is told of another one lost: their streams end with the coordinator."""
    name = "coordinator-stopping"
    coord, (agent,) = P.cluster(cl, binary, work, 1, tag="-" + name)
    P.wait_registered(P.Conn(coord.addr), [agent.addr])
    procs = P.spawn_job(cl, name, 2, agent.addr, {"*": {"steps": [END]}})
    for p in procs:
        P.check(p.wait("ready", 10) is not None, "%s: %s" % (name, p.describe()))
    rc = coord.stop(timeout=EXIT_S + 3)
    P.expect(rc == 0, "%s: the coordinator exited %s on SIGTERM" % (name, rc))
    want = "the coordinator at %s is stopping" % coord.addr
    for p in procs:
        je = p.wait("join_end", 10)
        P.expect(je is not None and je["code"] == "UNAVAILABLE" and want in je["message"],
                 "%s: %s's Join should end UNAVAILABLE '%s ...': %s" % (name, p.name, want,
                                                                        p.describe()))
        P.expect(not p.events("lost"), "%s: %s was told of a lost rank while the coordinator "
                 "was stopping: %s" % (name, p.name, p.describe()))


def many_stopping(cl, binary, work):
    """Agents that said they were stopping stay listed, the latest 32 of them (a
    rollout gives each agent a new address); one that registers again is back."""
    name = "many-stopping"
    coord = cl.add(P.Daemon(binary, work, name, ["--role", "coordinator"])).start()
    pb, pb_grpc = P.stubs()
    conn = P.Conn(coord.addr)
    stub = pb_grpc.CoordinatorStub(conn.channel)
    addrs = ["10.9.0.%d:29500" % i for i in range(40)]
    for a in addrs:
        stub.RegisterAgent(pb.RegisterAgentRequest(address=a), timeout=5)
        stub.RegisterAgent(pb.RegisterAgentRequest(address=a, stopping="test"), timeout=5)
    stub.RegisterAgent(pb.RegisterAgentRequest(address=addrs[-1]), timeout=5)
    st = conn.status()
    P.expect(list(st.stopping_agents) == addrs[8:39] and list(st.agents) == addrs[39:],
             "%s: after 40 agents stopped (the latest 32 kept) and the last came back, want "
             "the 31 before it stopping and it registered; got stopping %s, registered %s"
             % (name, list(st.stopping_agents), list(st.agents)))
    conn.close()


def doorbell_forwarded(cl, binary, work):
    name = "doorbell-forwarded"
    bench = bench_path(name)
    if not bench:
        return
    coord, (hub, other) = P.cluster(cl, binary, work, 2, common=["--liveness-timeout-ms", "2000"],
                                    tag="-" + name, metrics=True)
    P.wait_registered(P.Conn(coord.addr), [hub.addr, other.addr])
    # Rank 0 joins through `hub` (so it hosts the job) and never calls a collective.
    r0 = cl.add(P.WorkerProc({"addr": hub.addr, "job": name, "world": 2, "rank": 0,
                              "steps": [{"do": "wait_lost", "s": 60}], "hold_s": 60}))
    out = open(os.path.join(work, name + "-bench.log"), "w+")
    r1 = bench_rank1(bench, name, other.addr, out)
    try:
        P.check(r0.wait("ready", 30) is not None, r0.describe())
        # The first barrier waits at the hub for rank 0: wait until the hub has it.
        wait_at_hub(hub, name, r1)
        t = time.monotonic()
        rc = other.stop(timeout=EXIT_S + 3)
        dt = time.monotonic() - t
        P.log("%s: SIGTERM -> exit status %s after %.2fs" % (name, rc, dt))
        P.expect(rc == 0 and dt <= EXIT_S, "%s: the agent exited %s after %.2fs, want 0 "
                 "within %.0fs; its log:\n%s" % (name, rc, dt, EXIT_S, other.log_text()[-2000:]))
        try:
            brc = r1.wait(timeout=10)
        except subprocess.TimeoutExpired:
            r1.kill()
            brc = "still waiting 10s later"
        out.seek(0)
        text = out.read()
        P.log("%s: paramsync-bench exited %s: %s" % (name, brc, text.strip()[-300:]))
        P.expect(brc == 1 and ("shutting down" in text or "it is stopping" in text),
                 "%s: rank 1's barrier on the doorbell should fail saying the agent is "
                 "stopping; paramsync-bench exited %s and said:\n%s" % (name, brc, text))
        # Rank 0 hears why rank 1 is gone, and the coordinator lists the agent as stopping.
        lost = r0.wait("lost", 10)
        want = "its agent at %s is stopping: paramsyncd is shutting down" % other.addr
        P.expect(lost is not None and want in lost["message"],
                 "%s: rank 0 should hear that rank 1 was lost because its agent is stopping "
                 "('%s'): %s" % (name, want, r0.describe()))
        expect_stopped_counts(name, coord)
        st = P.Conn(coord.addr).status()
        agents, stopping = list(st.agents), list(st.stopping_agents)
        P.expect(agents == [hub.addr] and stopping == [other.addr],
                 "%s: the coordinator lists agents %s and stopping agents %s after %s stopped"
                 % (name, agents, stopping, other.addr))
        cli = os.path.join(os.path.dirname(binary), "paramsync")
        text = subprocess.run([cli, "status", "--addr", coord.addr], capture_output=True,
                              text=True, timeout=30).stdout
        P.expect("agents stopping (1): %s" % other.addr in text,
                 "%s: `paramsync status` should list %s as stopping:\n%s"
                 % (name, other.addr, text))
    finally:
        if r1.poll() is None:
            r1.kill()
            r1.wait()


if __name__ == "__main__":
    main()
