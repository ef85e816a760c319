#!/usr/bin/python3
"""An agent SIGKILLed under a small all_reduce that goes by recursive doubling.

Job "rd" (4 ranks, one on each of four agents; --ring on --ring-min-bytes 0,
so a 16-byte all_reduce is combined between the agents, and by recursive
doubling: pairs (0,1) and (2,3), then (0,2) and (1,3), a Ring call each):
ranks 0, 1 and 2 call the all_reduce, rank 3 does not, and agent3 is killed
while they wait. agent3 already holds the collective (agents 1 and 2 opened
their calls to it), so each survivor's wait ends through a partner: the calls
to agent3 break, and agent0, which has none, hears it from agent1 or agent2.
Ranks 0, 1 and 2 must get ABORTED or UNAVAILABLE naming rank 3 or agent3
within 2x the liveness timeout; agents 0-2 serve on, and a new job of three
ranks on them all_reduces correctly by recursive doubling (with an extra
agent folded in and out).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402
import test_agent_killed as K  # noqa: E402

COUNT = 4  # float32 elements: 16 bytes


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-rd-")
    common = ["--liveness-timeout-ms", str(K.LIVENESS_MS), "--ring", "on",
              "--ring-min-bytes", "0"]
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 4, common=common, metrics=True)
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])

        small = {"do": "collective", "kind": "ALL_REDUCE", "count": COUNT, "verify": True}
        specs = {r: {"steps": [small, {"do": "leave"}]} for r in range(3)}
        specs[3] = {"steps": [{"do": "sleep", "s": 60}]}
        procs = P.spawn_job(cl, "rd", 4, lambda r: agents[r].addr, specs)
        for p in procs[:3]:
            P.check(p.wait("coll_start", 30) is not None, "no all_reduce: " + p.describe())
        time.sleep(0.5)  # the calls reach agent3
        K.kill_under(agents[3], 3, procs[:3], "recursive doubling", [coord] + agents[:3])

        # Three agents: 0 and 1 pair up, 2 folds into 0.
        specs = {"*": {"steps": [small, {"do": "leave"}]}}
        procs = P.spawn_job(cl, "after", 3, lambda r: agents[r].addr, specs)
        for p in procs:
            ev = p.wait("coll", 30)
            P.expect(ev is not None and ev["code"] == "OK" and ev.get("verified"),
                     "an all_reduce across three agents failed after agent3 died: " +
                     p.describe())
        series = 'paramsync_agent_collectives_total{algorithm="recursive_doubling"} '
        counts = [sum(float(line[len(series):]) for line in a.metrics().splitlines()
                      if line.startswith(series)) for a in agents[:3]]
        P.expect(all(c >= 2 for c in counts),
                 "recursive doubling not counted twice (both jobs) on agents 0-2: %s" % counts)
        P.expect_stopped(*agents[:3], coord)
    P.done()


if __name__ == "__main__":
    main()
