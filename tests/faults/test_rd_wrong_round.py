#!/usr/bin/python3
"""A ring link that sends recursive doubling a frame of the wrong round.

Job "rd" (3 ranks, one on each of three agents; --ring on --ring-min-bytes 0,
so a 16-byte all_reduce goes between the agents by recursive doubling: agents
0 and 1 are the core, agent2 the extra, which opens a Ring call to agent0 and
sends its value in round 0, then gets the result on it). Before any rank
calls, a rogue Ring call to agent0 claims agent2's place and sends a frame of
round 7; ranks 0 and 1 call, rank 2 does not (its agent would open the link
the rogue holds). Rank 0 must get INVALID_ARGUMENT naming the round ("sent
round 7 where round 0 belongs"), rank 1 an error too, within a few seconds; both agents then serve a correct
all_reduce of a new job and exit 0 on SIGTERM. (The fault this guards: the
wait for the partner's frame asked whether the collective had failed before
taking the frame, which fails it: the agent then waited for ever, held the
collective and never exited.)
"""
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

COUNT = 4  # float32 elements: 16 bytes
WRONG_ROUND = 7


def rogue_ring(pb, addr, hdr):
    """Opens Agent.Ring to addr, sends hdr's frame and one data frame of the wrong
    round. Returns (a function that ends the call and gives its outcome)."""
    conn = P.Conn(addr)
    ring = conn.channel.stream_stream("/paramsync.v1.Agent/Ring",
                                      request_serializer=pb.Frame.SerializeToString,
                                      response_deserializer=pb.Frame.FromString)
    frames = queue.Queue()
    frames.put(pb.Frame(header=hdr))
    frames.put(pb.Frame(offset=WRONG_ROUND, data=P.floats([1.0] * COUNT)))

    def reqs():
        while True:
            f = frames.get()
            if f is None:
                return
            yield f

    call = ring(reqs(), timeout=30)
    out = {}

    def drain():
        try:
            for _ in call:
                pass
            out["outcome"] = P.RpcOutcome(0, "")
        except P.grpc.RpcError as e:
            out["outcome"] = P._err(e)

    t = threading.Thread(target=drain, daemon=True)
    t.start()

    def finish():
        frames.put(None)
        t.join(15)
        conn.close()
        return out.get("outcome")

    return finish


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-rdround-")
    common = ["--ring", "on", "--ring-min-bytes", "0"]
    pb, _ = P.stubs()
    with P.Cleanup() as cl:
        coord, agents = P.cluster(cl, binary, work, 3, common=common)
        P.wait_registered(P.Conn(coord.addr), [a.addr for a in agents])
        members = P.join_all([a.addr for a in agents], "rd", 3)

        # Agent positions follow their first rank: agent2 is the extra, at 2.
        hdr = pb.CollectiveHeader(job="rd", group=0, seq=0, kind=pb.ALL_REDUCE, op=pb.SUM,
                                  dtype=pb.FLOAT32, count=COUNT, rank=2,
                                  incarnation=members[0].incarnation)
        finish = rogue_ring(pb, agents[0].addr, hdr)
        time.sleep(0.5)  # agent0 takes the link and its frame

        t0 = time.monotonic()
        outs = P.in_threads([
            lambda m=m: m.collective("ALL_REDUCE", COUNT, P.rank_tensor(m.rank, COUNT),
                                     rpc_timeout=30) for m in members[:2]], timeout=40)
        took = time.monotonic() - t0
        P.log("rank 0: %r; rank 1: %r (%.1f s)" % (outs[0], outs[1], took))
        want = "sent round %d where round 0 belongs" % WRONG_ROUND
        P.expect(isinstance(outs[0], P.RpcOutcome) and outs[0].name == "INVALID_ARGUMENT" and
                 want in outs[0].message,
                 "rank 0 (agent0) should fail INVALID_ARGUMENT '%s': %r" % (want, outs[0]))
        P.expect(isinstance(outs[1], P.RpcOutcome) and outs[1].code != 0,
                 "rank 1 (agent1) should fail with agent0: %r" % (outs[1],))
        P.expect(took < 10, "the ranks heard of the wrong round after %.1f s" % took)
        rogue = finish()
        P.log("the rogue Ring call: %r" % (rogue,))
        P.expect(rogue is not None and rogue.code != 0,
                 "agent1 ended the rogue Ring call with %r" % (rogue,))
        for m in members:
            m.leave()

        # The agents serve on: a new job all_reduces correctly between them.
        res = P.run_ranks([a.addr for a in agents], "after", 3, count=COUNT)
        P.expect(P.all_ok(res), "an all_reduce after the rogue link failed: %s" % res)
        P.expect_alive(coord, *agents)
        P.expect_stopped(*agents, coord)
    P.done()


if __name__ == "__main__":
    main()
