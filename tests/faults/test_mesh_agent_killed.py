#!/usr/bin/python3
"""An agent SIGKILLed under an all_to_all that goes over the mesh of agents.

Job "mesh" (3 ranks, one on each of three agents; blocks of 4 MiB, so that
--ring auto sends each straight from its owner's agent to its rank's, over a
link between every two agents): agent2 is killed while its rank is partway
through sending. Ranks 0 and 1, whose agents each have links to and from
agent2 besides the one between them, must get ABORTED or UNAVAILABLE naming
rank 2 or agent2 within 2x the liveness timeout (killed before rank 2 sent its first
block, so no rank can be done); agent0 and agent1 serve on,
and a new job of ranks on both all_to_alls over the mesh correctly.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402
import test_agent_killed as K  # noqa: E402

BLOCK = 1 << 20  # float32 elements per block: 4 MiB


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-mesh-")
    live = ["--liveness-timeout-ms", str(K.LIVENESS_MS)]
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 3, common=live)
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])
        a0, a1, a2 = agents

        big = {"do": "collective", "kind": "ALL_TO_ALL", "count": BLOCK, "raw": True}
        slow = dict(big, slow_s=0.2, announce_after=1 << 20)
        specs = {0: {"steps": [big, {"do": "leave"}]}, 1: {"steps": [big, {"do": "leave"}]},
                 2: {"steps": [slow]}}
        procs = P.spawn_job(cl, "mesh", 3, lambda r: agents[r].addr, specs)
        P.check(procs[2].wait("sending", 30) is not None,
                "rank 2 never got 1 MiB out: " + procs[2].describe())
        K.kill_under(a2, 2, procs[:2], "the mesh all_to_all", [coord, a0, a1])

        # The two survivors still all_to_all over the mesh (here: their one link each way).
        specs = {"*": {"steps": [dict(big, kind="ALL_TO_ALL"), {"do": "leave"}]}}
        procs = P.spawn_job(cl, "after", 2, lambda r: agents[r].addr, specs)
        for p in procs:
            ev = p.wait("coll", 30)
            P.expect(ev is not None and ev["code"] == "OK" and ev["bytes"] == 2 * BLOCK * 4,
                     "an all_to_all across agent0 and agent1 failed after agent2 died: " +
                     p.describe())
        P.expect_stopped(a0, a1, coord)
    P.done()


if __name__ == "__main__":
    main()
