#!/usr/bin/python3
"""The coordinator SIGKILLed and restarted on the same port, agents left running.

Before: job "inflight" (rank 0 on agent0, the hub; rank 1 on agent1). Rank 0
waits in a barrier for rank 1, which is alive but has not called it yet.
The coordinator is killed. Within 2x the liveness timeout:
  * both workers' Join streams end with UNAVAILABLE naming the coordinator;
  * rank 0's barrier, in flight, ends with UNAVAILABLE or ABORTED (it can
    never complete: the job's membership is gone).
Then the coordinator is started again on the same port. Without restarting
either agent, both register again on their own, and a NEW job (rank 0 on
agent1 this time, so collectives cross agents the other way) all_reduces
correctly; the old job id can be formed again too.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

LIVENESS_MS = 2000
BOUND_S = 2 * LIVENESS_MS / 1000.0
RECONNECT_S = 20  # agents must be back within this after the restart


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-coord-")
    live = ["--liveness-timeout-ms", str(LIVENESS_MS)]
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 2, common=live)
        a0, a1 = agents
        P.wait_registered(P.Conn(coord.addr), [a0.addr, a1.addr])

        at = {0: a0.addr, 1: a1.addr}
        specs = {0: {"steps": [{"do": "collective", "kind": "BARRIER"},
                               {"do": "wait_join_end", "s": BOUND_S + 5}]},
                 1: {"steps": [{"do": "wait_join_end", "s": BOUND_S + 5}]}}
        procs = P.spawn_job(cl, "inflight", 2, lambda r: at[r], specs)
        P.check(procs[0].wait("coll_start", 10) is not None, "no coll_start: " +
                procs[0].describe())
        time.sleep(0.5)
        P.check(not procs[0].events("coll"), "the barrier ended before the kill: " +
                procs[0].describe())
        t_kill = time.monotonic()
        coord.kill()
        P.log("coordinator killed")
        for p in procs:
            ev = p.wait("join_end", BOUND_S + 6)
            P.expect(ev is not None, "%s: its Join stream did not end within %.1fs of the "
                     "coordinator's death: %s" % (p.name, BOUND_S + 6, p.describe()))
            if ev is None:
                continue
            dt = ev["t"] - t_kill
            P.log("%s: Join ended %.2fs after the kill: %s %r" % (p.name, dt, ev["code"],
                                                                   ev["message"]))
            P.expect(ev["code"] == "UNAVAILABLE", "%s: Join ended with %s %r, want UNAVAILABLE" %
                     (p.name, ev["code"], ev["message"]))
            P.expect("coordinator" in ev["message"],
                     "%s: the Join error does not name the coordinator: %r" %
                     (p.name, ev["message"]))
            P.expect(dt <= BOUND_S, "%s: Join ended %.2fs after the kill (bound %.1fs)" %
                     (p.name, dt, BOUND_S))
        ev = procs[0].wait("coll", BOUND_S + 3 - (time.monotonic() - t_kill))
        P.expect(ev is not None, "the barrier in flight did not end within %.1fs of the "
                 "coordinator's death (it can never complete): %s" %
                 (BOUND_S, procs[0].describe()))
        if ev is not None:
            dt = ev["t"] - t_kill
            P.log("barrier in flight ended %.2fs after the kill: %s %r" %
                  (dt, ev["code"], ev["message"]))
            P.expect(ev["code"] in ("UNAVAILABLE", "ABORTED"),
                     "the barrier in flight ended with %s %r, want UNAVAILABLE or ABORTED" %
                     (ev["code"], ev["message"]))
            P.expect(dt <= BOUND_S, "the barrier in flight ended %.2fs after the kill "
                     "(bound %.1fs)" % (dt, BOUND_S))
        for p in procs:
            p.kill()

        # Restart on the same port; the agents are the same processes.
        time.sleep(1.0)
        t_restart = time.monotonic()
        coord.start()
        P.check(a0.alive() and a1.alive(), "an agent died with the coordinator")
        P.wait_registered(P.Conn(coord.addr), [a0.addr, a1.addr], timeout=RECONNECT_S)
        P.log("both agents registered again %.2fs after the restart" %
              (time.monotonic() - t_restart))

        for job in ("after-restart", "inflight"):
            at = {0: a1.addr, 1: a0.addr, 2: a0.addr}
            specs = {"*": {"steps": [{"do": "collective", "count": 100000, "verify": True},
                                     {"do": "collective", "count": 3, "verify": True},
                                     {"do": "leave"}]}}
            procs = P.spawn_job(cl, job, 3, lambda r: at[r], specs)
            P.expect(procs[0].wait("ready", 1)["hub"] == a1.addr,
                     "the hub of %s is not agent1: %s" % (job, procs[0].describe()))
            for p in procs:
                evs = []
                end = time.monotonic() + 30
                while len(evs) < 2 and time.monotonic() < end:
                    time.sleep(0.05)
                    evs = p.events("coll")
                P.expect(len(evs) == 2 and all(e["code"] == "OK" and e["verified"] for e in evs),
                         "job %s after the coordinator's restart failed: %s" %
                         (job, p.describe()))
                P.expect(p.finish(15) == 0, "%s did not end: %s" % (p.name, p.describe()))
            P.log("job %s after the restart: all_reduce correct on 3 ranks over 2 agents" % job)
        P.expect_stopped(a0, a1, coord)
    P.done()


if __name__ == "__main__":
    main()
