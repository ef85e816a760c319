#!/usr/bin/python3
"""Elastic restart, torchrun-style, with no daemon restarted.

Job "elastic", 3 ranks over a coordinator and two agents (ranks 0, 1 on
agent0; rank 2 on agent1). All three all_reduce correctly; rank 2 is then
SIGKILLed while 0 and 1 wait for it in a second all_reduce, which fails
naming rank 2. The survivors leave and join the same job id again:
  phase A: world size 3, with a replacement process (rank -1: the coordinator
           assigns the free rank 2) on agent1 -> a new incarnation, and a
           correct all_reduce of all three;
  phase B: the replacement is SIGKILLed in turn while the others wait for it;
           the two left form the job with world size 2 -> another new
           incarnation, a correct all_reduce.
Both daemons must be the same processes throughout.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

LIVENESS_MS = 2000
BOUND_S = 2 * LIVENESS_MS / 1000.0
COUNT = 50000


def colls(p, n, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        evs = p.events("coll")
        if len(evs) >= n:
            return evs
        if p.proc.poll() is not None and p.wait("eof", 0.2):
            break
        time.sleep(0.05)
    return p.events("coll")


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-elastic-")
    live = ["--liveness-timeout-ms", str(LIVENESS_MS)]
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 2, common=live)
        a0, a1 = agents
        P.wait_registered(P.Conn(coord.addr), [a0.addr, a1.addr])
        pids = [d.proc.pid for d in (coord, a0, a1)]

        ok = {"do": "collective", "count": COUNT, "verify": True}
        # Each rejoin asks for rank -1: the coordinator hands out the free ranks.
        survivor = {"steps": [ok, dict(ok, verify=False),
                              {"do": "rejoin", "world": 3}, ok, dict(ok, verify=False),
                              {"do": "rejoin", "world": 2}, ok, {"do": "leave"}]}
        at = {0: a0.addr, 1: a0.addr, 2: a1.addr}
        specs = {0: survivor, 1: survivor, 2: {"steps": [ok, {"do": "sleep", "s": 120}]}}
        procs = P.spawn_job(cl, "elastic", 3, lambda r: at[r], specs)
        inc0 = procs[0].wait("ready", 1)["incarnation"]
        for p in procs:
            evs = colls(p, 1, 30)
            P.check(evs and evs[0]["code"] == "OK" and evs[0]["verified"],
                    "the first all_reduce failed: " + p.describe())
        time.sleep(0.5)  # ranks 0 and 1 now wait for rank 2 in the second all_reduce
        t_kill = time.monotonic()
        procs[2].kill()
        for p in procs[:2]:
            evs = colls(p, 2, BOUND_S + 10)
            P.check(len(evs) >= 2, "%s: the second all_reduce did not end after rank 2's "
                    "death: %s" % (p.name, p.describe()))
            ev = evs[1]
            P.expect(ev["code"] in ("ABORTED", "UNAVAILABLE") and
                     P.names_rank(ev["message"], 2) and ev["t"] - t_kill <= BOUND_S,
                     "%s: want ABORTED/UNAVAILABLE naming rank 2 within %.1fs, got %s %r "
                     "after %.2fs" % (p.name, BOUND_S, ev["code"], ev["message"],
                                      ev["t"] - t_kill))

        # Phase A: the survivors and a replacement form the job again, world size 3.
        repl = cl.add(P.WorkerProc({"addr": a1.addr, "job": "elastic", "world": 3, "rank": -1,
                                    "steps": [ok, {"do": "sleep", "s": 120}]},
                                   name="replacement"))
        readies = []
        for p in procs[:2] + [repl]:
            ev = p.wait("ready", 30, pred=lambda x: x["incarnation"] != inc0)
            P.check(ev is not None, "%s did not join the re-formed job: %s" %
                    (p.name, p.describe()))
            readies.append(ev)
        incA = readies[0]["incarnation"]
        P.expect(all(r["incarnation"] == incA and r["world"] == 3 for r in readies),
                 "phase A: READY events disagree: %s" % readies)
        P.expect(incA != inc0, "phase A: the incarnation did not change (%s)" % incA)
        P.expect(sorted(r["rank"] for r in readies) == [0, 1, 2],
                 "phase A: ranks are not 0, 1, 2: %s" % readies)
        for p, n in ((procs[0], 3), (procs[1], 3), (repl, 1)):
            evs = colls(p, n, 30)
            P.expect(len(evs) >= n and evs[n - 1]["code"] == "OK" and evs[n - 1]["verified"],
                     "phase A: the all_reduce of the re-formed job failed: " + p.describe())
        P.log("phase A: job 'elastic' re-formed with a replacement, incarnation %d -> %d, "
              "all_reduce correct" % (inc0, incA))
        time.sleep(0.5)  # the others now wait for the replacement in another all_reduce
        t_kill = time.monotonic()
        repl.kill()
        victim = [r["rank"] for r in readies][2]
        for p in procs[:2]:
            evs = colls(p, 4, BOUND_S + 10)
            P.check(len(evs) >= 4, "%s: the all_reduce did not end after the replacement's "
                    "death: %s" % (p.name, p.describe()))
            ev = evs[3]
            P.expect(ev["code"] in ("ABORTED", "UNAVAILABLE") and
                     P.names_rank(ev["message"], victim) and ev["t"] - t_kill <= BOUND_S,
                     "%s: want ABORTED/UNAVAILABLE naming rank %d within %.1fs, got %s %r "
                     "after %.2fs" % (p.name, victim, BOUND_S, ev["code"], ev["message"],
                                      ev["t"] - t_kill))

        # Phase B: world size 2.
        readies = []
        for p in procs[:2]:
            ev = p.wait("ready", 30, pred=lambda x: x["incarnation"] not in (inc0, incA))
            P.check(ev is not None, "%s did not join the world-2 job: %s" %
                    (p.name, p.describe()))
            readies.append(ev)
        incB = readies[0]["incarnation"]
        P.expect(all(r["incarnation"] == incB and r["world"] == 2 for r in readies),
                 "phase B: READY events disagree: %s" % readies)
        for p in procs[:2]:
            evs = colls(p, 5, 30)
            P.expect(len(evs) >= 5 and evs[4]["code"] == "OK" and evs[4]["verified"],
                     "phase B: the all_reduce of the world-2 job failed: " + p.describe())
            P.expect(p.finish(15) == 0, "%s did not end: %s" % (p.name, p.describe()))
        P.log("phase B: job 'elastic' re-formed with world size 2, incarnation %d, "
              "all_reduce correct" % incB)

        P.expect([d.proc.pid for d in (coord, a0, a1)] == pids and
                 all(d.alive() for d in (coord, a0, a1)), "a daemon was restarted or died")
        P.expect_stopped(a0, a1, coord)
    P.done()


if __name__ == "__main__":
    main()
