#!/usr/bin/python3
"""A link kept open between two agents, whose far end is killed and started again.

Agents keep the Ring call of a collective that succeeded open for the job's next
collective to the same agent (--link-keep-ms). Job "kept" (2 ranks, one on each of
two agents; all_to_all blocks of 4 MiB, so that --ring auto sends them over the mesh)
runs two all_to_alls: agent0 opens its link to agent1 for the first and keeps it for
the second. agent1 is then SIGKILLed, which leaves agent0 a kept link to a dead
process, and started again on the same address. A new job of the same name
all_to_alls correctly: agent0 drops the dead link and opens another (its
paramsync_agent_links_total{link="opened"} grows), rather than failing the
collective on it; and both agents still exit 0 on SIGTERM.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

BLOCK = 1 << 20  # float32 elements per block: 4 MiB


def links(agent, how):
    m = re.search(r'^paramsync_agent_links_total\{link="%s"\} (\d+)$' % how, agent.metrics(),
                  re.M)
    P.check(m is not None, "%s exposes no paramsync_agent_links_total{link=%r}" %
            (agent.name, how))
    return int(m.group(1))


def all_to_alls(cl, agents, n):
    """Job "kept": n all_to_alls of ranks 0 (agent0) and 1 (agent1), each checked."""
    a2a = {"do": "collective", "kind": "ALL_TO_ALL", "count": BLOCK, "raw": True}
    specs = {"*": {"steps": [a2a] * n + [{"do": "leave"}]}}
    procs = P.spawn_job(cl, "kept", 2, lambda r: agents[r].addr, specs)
    for p in procs:
        P.expect(p.finish(60) == 0, "worker %s did not end: %s" % (p.name, p.describe()))
        evs = p.events("coll")
        P.check(len(evs) == n and all(e["code"] == "OK" and e["bytes"] == 2 * BLOCK * 4
                                      for e in evs),
                "job kept: %d all_to_alls, not all OK: %s" % (n, p.describe()))


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-link-")
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 2, metrics=True,
                                  common=["--liveness-timeout-ms", "2000"])
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])
        a0, a1 = agents

        all_to_alls(cl, agents, 2)
        opened, kept = links(a0, "opened"), links(a0, "kept")
        P.check(opened >= 1 and kept >= 1,
                "agent0 opened %d links and kept %d over two all_to_alls (want 1 or more of "
                "each: the second takes the first's link)" % (opened, kept))
        P.log("two all_to_alls: agent0 opened %d links, took %d kept ones" % (opened, kept))

        a1.kill()
        a1.start()
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])
        all_to_alls(cl, agents, 1)
        opened2 = links(a0, "opened")
        P.expect(opened2 > opened,
                 "agent0 opened no new link to the restarted agent1 (%d, %d before): it "
                 "sent on the dead one" % (opened2, opened))
        P.log("after agent1's restart: agent0 opened %d links (%d before)" % (opened2, opened))
        P.expect_stopped(a0, a1, coord)
    P.done()


if __name__ == "__main__":
    main()
