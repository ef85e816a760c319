#!/usr/bin/python3
"""An agent SIGKILLed in a multi-agent run (a coordinator and three agents).

1. Job "split" (4 ranks: 0,1 on agent0, the hub; 2,3 on agent1): agent1 is
   killed while ranks 2 and 3 are halfway through sending a 64 MiB tensor.
   Ranks 0 and 1 must get ABORTED or UNAVAILABLE naming rank 2 or 3 within
   2x the liveness timeout, and MEMBER_LOST for 2 and 3; the coordinator's
   Admin/Status must show ranks 2 and 3 "lost".
2. Job "remote-hub" (2 ranks: 0 on agent2, which is the hub; 1 on agent0):
   rank 1 waits in a barrier for rank 0 and agent2 (the hub) is killed. Rank
   1 must get ABORTED or UNAVAILABLE naming rank 0 or agent2's address within
   the bound; Status must show rank 0 "lost".
3. agent0 still serves: a new job through it all_reduces correctly.

--ring MODE goes to every paramsyncd: with auto (the default) the 64 MiB
all_reduce of job "split" (2 ranks per agent) goes round the ring of agent0
and agent1, so agent1's death breaks a ring link; with off it goes through
the hub, which loses agent1's forwarded ranks.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

LIVENESS_MS = 2000
BOUND_S = 2 * LIVENESS_MS / 1000.0
BIG = 16 << 20  # float32 elements: 64 MiB


def rank_states(addr, job, want, until):
    """The coordinator's view of job's ranks {rank: state}, asked again until it
    matches want (a {rank: state} subset) or until time.monotonic() > until. Each
    ask on a new connection, as `paramsync status` does (an idle grpcio channel
    answers no keepalive pings, so the daemon closes it after 2x the liveness
    timeout and the next call on it fails)."""
    while True:
        try:
            conn = P.Conn(addr)
            st = conn.status(job)
            conn.close()
        except P.grpc.RpcError as e:
            return {}, "Admin/Status failed: %s %s" % (e.code().name, e.details())
        states = {}
        for j in st.jobs:
            if j.job == job:
                states = {r.rank: r.state for r in j.ranks}
        if all(states.get(r) == s for r, s in want.items()) or time.monotonic() > until:
            return states, st
        time.sleep(0.05)


def check_error(p, t_kill, ok_names, what):
    ev = p.wait("coll", BOUND_S + 10)
    P.check(ev is not None, "%s: %s got no answer within %.1fs of the kill: %s" %
            (what, p.name, BOUND_S + 10, p.describe()))
    dt = ev["t"] - t_kill
    P.expect(ev["code"] in ("ABORTED", "UNAVAILABLE"),
             "%s: %s got %s %r, want ABORTED or UNAVAILABLE" %
             (what, p.name, ev["code"], ev["message"]))
    P.expect(any(n(ev["message"]) for n in ok_names),
             "%s: %s's error names neither the lost rank(s) nor the dead agent: %r" %
             (what, p.name, ev["message"]))
    P.expect(dt <= BOUND_S, "%s: %s's error came %.2fs after the kill (bound %.1fs)" %
             (what, p.name, dt, BOUND_S))
    return dt, ev["message"]


def kill_under(agent, rank, survivors, under, alive):
    """Kills agent (whose rank is `rank`) while the survivors wait in a collective
    (`under`: what it is, for the log); each must fail as check_error wants, naming the
    rank or the agent, and end; the daemons in alive must still be running."""
    P.check(not survivors[0].events("coll"), "the collective ended before the kill: " +
            survivors[0].describe())
    t_kill = time.monotonic()
    agent.kill()
    what = "%s killed" % agent.name
    for p in survivors:
        dt, msg = check_error(p, t_kill, [lambda m: P.names_rank(m, rank),
                                          lambda m: agent.addr in m], what)
        P.log("%s under %s: %s failed %.2fs later: %s" % (what, under, p.name, dt, msg))
    for p in survivors:
        P.expect(p.finish(20) == 0, "worker %s did not end: %s" % (p.name, p.describe()))
    P.check(P.expect_alive(*alive), "a daemon that should be running died")


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-agent-")
    live = ["--liveness-timeout-ms", str(LIVENESS_MS)]
    if "--ring" in sys.argv:
        live += ["--ring", sys.argv[sys.argv.index("--ring") + 1]]
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 3, common=live)
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])
        a0, a1, a2 = agents

        # 1. A non-hub agent dies mid-collective.
        at = {0: a0.addr, 1: a0.addr, 2: a1.addr, 3: a1.addr}
        big = {"do": "collective", "count": BIG, "raw": True}
        slow = dict(big, slow_s=0.05, announce_after=8 << 20)
        specs = {0: {"steps": [big, {"do": "wait_lost", "s": BOUND_S},
                               {"do": "sleep", "s": 6}, {"do": "leave"}]},
                 2: {"steps": [slow]}, 3: {"steps": [slow]}}
        specs[1] = specs[0]
        procs = P.spawn_job(cl, "split", 4, lambda r: at[r], specs)
        P.check(procs[0].wait("ready", 1)["hub"] == a0.addr,
                "the hub of 'split' is not agent0 (rank 0's agent): " + procs[0].describe())
        P.check(procs[2].wait("sending", 30) is not None, "rank 2 never got 8 MiB out: " +
                procs[2].describe())
        time.sleep(0.2)
        P.check(not procs[0].events("coll"), "the collective ended before the kill: " +
                procs[0].describe())
        t_kill = time.monotonic()
        a1.kill()
        for p in procs[:2]:
            dt, msg = check_error(p, t_kill, [lambda m: P.names_rank(m, 2),
                                              lambda m: P.names_rank(m, 3)], "agent1 killed")
            P.log("agent1 killed mid-collective: %s failed %.2fs later: %s" % (p.name, dt, msg))
        # The survivors stay members for a while: the job is still there to look at.
        P.expect_alive(coord, a0)
        states, st = rank_states(coord.addr, "split", {0: "joined", 1: "joined", 2: "lost",
                                                  3: "lost"}, t_kill + BOUND_S)
        P.log("coordinator Status of 'split' %.2fs after agent1's death: %s" %
              (time.monotonic() - t_kill, states))
        P.expect(states.get(2) == "lost" and states.get(3) == "lost",
                 "the coordinator's Status does not show ranks 2 and 3 lost: %s" % st)
        P.expect(states.get(0) == "joined" and states.get(1) == "joined",
                 "the coordinator's Status does not show ranks 0 and 1 joined: %s" % st)
        for p in procs[:2]:
            lost = p.wait("lost", BOUND_S + 1)
            P.expect(lost is not None and lost["rank"] in (2, 3),
                     "agent1 killed: %s saw no MEMBER_LOST for rank 2 or 3: %s" %
                     (p.name, p.describe()))
        for p in procs[2:]:
            ev = p.wait("coll", BOUND_S + 5)
            P.expect(ev is not None and ev["code"] in ("UNAVAILABLE", "ABORTED", "CANCELLED"),
                     "agent1 killed: its own worker %s did not get an error: %s" %
                     (p.name, p.describe()))
        for p in procs[:2]:
            P.expect(p.finish(20) == 0, "worker %s did not end: %s" % (p.name, p.describe()))

        # 2. The hub agent dies while a rank on another agent waits in a collective.
        at = {0: a2.addr, 1: a0.addr}
        specs = {0: {"steps": [{"do": "sleep", "s": 60}]},
                 1: {"steps": [{"do": "collective", "kind": "BARRIER"},
                               {"do": "wait_lost", "s": BOUND_S}, {"do": "sleep", "s": 6},
                               {"do": "leave"}]}}
        procs = P.spawn_job(cl, "remote-hub", 2, lambda r: at[r], specs)
        P.check(procs[1].wait("ready", 1)["hub"] == a2.addr,
                "the hub of 'remote-hub' is not agent2: " + procs[1].describe())
        P.check(procs[1].wait("coll_start", 10) is not None, "no coll_start: " +
                procs[1].describe())
        time.sleep(0.5)
        P.check(not procs[1].events("coll"), "the barrier ended before the kill: " +
                procs[1].describe())
        t_kill = time.monotonic()
        a2.kill()
        dt, msg = check_error(procs[1], t_kill, [lambda m: P.names_rank(m, 0),
                                                 lambda m: a2.addr in m], "agent2 (hub) killed")
        P.log("agent2 (the hub) killed: rank 1 on agent0 failed %.2fs later: %s" % (dt, msg))
        P.expect_alive(coord, a0)
        states, st = rank_states(coord.addr, "remote-hub", {0: "lost", 1: "joined"},
                                 t_kill + BOUND_S)
        P.log("coordinator Status of 'remote-hub' %.2fs after agent2's death: %s" %
              (time.monotonic() - t_kill, states))
        P.expect(states.get(0) == "lost", "the coordinator's Status does not show rank 0 lost: "
                 "%s" % st)
        lost = procs[1].wait("lost", BOUND_S + 1)
        P.expect(lost is not None and lost["rank"] == 0,
                 "agent2 killed: rank 1 saw no MEMBER_LOST for rank 0: " + procs[1].describe())
        P.expect(procs[1].finish(20) == 0, "rank 1 did not end: " + procs[1].describe())

        P.check(P.expect_alive(coord, a0), "a daemon that should be running died")

        # 3. The surviving agent serves new jobs.
        specs = {"*": {"steps": [{"do": "collective", "count": 4096, "verify": True},
                                 {"do": "leave"}]}}
        procs = P.spawn_job(cl, "after", 2, a0.addr, specs)
        for p in procs:
            ev = p.wait("coll", 30)
            P.expect(ev is not None and ev["code"] == "OK" and ev["verified"],
                     "a new job through agent0 failed after the other agents died: " +
                     p.describe())
        P.expect_stopped(a0, coord)
    P.done()


if __name__ == "__main__":
    main()
