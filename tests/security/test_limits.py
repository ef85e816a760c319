#!/usr/bin/python3
"""Resource limits: each --max-* gives RESOURCE_EXHAUSTED with a message naming
the flag, and the daemon keeps serving other jobs correctly.

An embedded daemon with these limits small:
  --max-tensor-bytes 1M    an all_reduce of 2 MiB per rank
  --max-message-bytes 4M   one Frame of 5 MiB (the smallest allowed limit is 4M)
  --max-world-size 4       a join with world size 5
  --max-jobs 3             a 4th job while 3 are held
  --max-groups 2           a 3rd NewGroup in a job
and another with
  --max-inflight-bytes 8M  a collective whose window needs 12 MiB; and a 3 MiB one
                           while a stuck collective (a rank never arrives) pins 6 MiB
After each refusal a fresh job all_reduces correctly, and the daemon is the same
process (never killed for memory).
"""
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "faults"))
import psworker as P  # noqa: E402

MiB = 1 << 20


def main():
    binary = P.paramsyncd_path()
    pb, _ = P.stubs()
    grpc = P.grpc
    work = P.workdir("ps-security-limits-")
    with P.Cleanup() as cl:
        d = cl.add(P.Daemon(binary, work, "paramsyncd",
                            ["--max-tensor-bytes", "1M", "--max-message-bytes", "4M",
                             "--max-world-size", "4", "--max-jobs", "3",
                             "--max-groups", "2"])).start()
        pid = d.proc.pid
        serial = [0]

        def still_serving(after):
            serial[0] += 1
            r = P.run_ranks(d.addr, "other-%d" % serial[0], 2, count=1000)
            P.expect(P.all_ok(r), "after %s, another job's all_reduce failed: %s" % (after, r))
            P.expect(d.alive() and d.proc.pid == pid, "after %s the daemon is gone" % after)

        def exhausted(what, flag, outcome):
            code, msg = outcome
            P.expect(code == "RESOURCE_EXHAUSTED" and flag in msg,
                     "%s: want RESOURCE_EXHAUSTED naming %s, got %s %r" % (what, flag, code, msg))
            P.log("%s: %s %r" % (what, code, msg))

        def coll_outcomes(job, world, count, chunk=MiB):
            ms = P.join_all(d.addr, job, world)
            res = P.in_threads([lambda m=m: m.collective(
                "ALL_REDUCE", count, bytes(count * 4), chunk=chunk) for m in ms])
            for m in ms:
                m.leave()
            return res

        # --max-tensor-bytes
        res = coll_outcomes("tensor", 2, (2 * MiB) // 4)
        for r in res:
            exhausted("a 2 MiB all_reduce", "--max-tensor-bytes", (r.name, r.message))
        still_serving("--max-tensor-bytes")

        # --max-message-bytes: one 5 MiB frame (under --max-tensor-bytes? no: the frame
        # limit is checked by gRPC before the tensor size; use a byte-count that fits in
        # neither, the frame limit comes first).
        m = P.join_all(d.addr, "message", 1)[0]
        r = m.collective("ALL_REDUCE", (5 * MiB) // 4, bytes(5 * MiB), chunk=5 * MiB)
        # gRPC refuses the message before paramsync sees it, so the text is
        # gRPC's own ("larger than max (N vs. M)"), stating the limit in bytes.
        exhausted("a 5 MiB frame", "larger than max", (r.name, r.message))
        P.expect(str(4 * MiB) in r.message,
                 "a 5 MiB frame: the refusal does not state the 4M limit: %r" % r.message)
        m.leave()
        still_serving("--max-message-bytes")

        # --max-world-size
        r = P.Member(P.Conn(d.addr)).join("world", 5, 0, wait_s=10)
        exhausted("a join with world size 5", "--max-world-size",
                  (r.name, r.message) if isinstance(r, P.RpcOutcome) else ("OK", str(r)))
        still_serving("--max-world-size")

        # --max-groups
        m = P.join_all(d.addr, "groups", 1)[0]
        outs = []
        for g in (1, 2, 3):
            try:
                resp = m.conn.worker.NewGroup(pb.NewGroupRequest(job="groups", group=g,
                                                                 ranks=[0], rank=0),
                                              timeout=10)
                outs.append(("OK", str(resp)))
            except grpc.RpcError as e:
                outs.append((e.code().name, e.details()))
        P.expect(outs[0][0] == "OK" and outs[1][0] == "OK",
                 "the first 2 groups were refused: %s" % outs)
        exhausted("a 3rd group", "--max-groups", outs[2])
        m.leave()
        still_serving("--max-groups")

        # --max-jobs: 3 held (world 1, joined), the 4th refused; then one leaves and a new
        # job fits again.
        held = [P.join_all(d.addr, "held-%d" % i, 1)[0] for i in range(3)]
        r = P.Member(P.Conn(d.addr)).join("one-too-many", 1, 0, wait_s=10)
        exhausted("a 4th job", "--max-jobs",
                  (r.name, r.message) if isinstance(r, P.RpcOutcome) else ("OK", str(r)))
        held[0].leave()
        time.sleep(0.2)
        still_serving("--max-jobs")
        for h in held[1:]:
            h.leave()

        P.expect(d.stop() == 0, "paramsyncd did not exit 0 on SIGTERM")

        # --max-inflight-bytes: 2 ranks x 4 steps of 1 MiB (+ output) = 12 MiB > 8M.
        d = cl.add(P.Daemon(binary, work, "paramsyncd-inflight",
                            ["--max-inflight-bytes", "8M"])).start()
        pid = d.proc.pid
        res = coll_outcomes("inflight-big", 2, (4 * MiB) // 4 - 1)
        P.expect(all(x.code != 0 for x in res), "a 12 MiB window was admitted: %s" % res)
        exhausted("a collective needing a 12 MiB window", "--max-inflight-bytes",
                  (res[0].name, res[0].message))
        still_serving("--max-inflight-bytes (one big collective)")
        # A stuck collective (rank 1 never arrives) pins 2 steps x 3 x 1 MiB = 6 MiB;
        # another job's 3 MiB collective must then be refused, and admitted once the
        # stuck one fails (its 2 s timeout).
        stuck = P.join_all(d.addr, "stuck", 2)
        stuck_out = []
        t = threading.Thread(target=lambda: stuck_out.append(stuck[0].collective(
            "ALL_REDUCE", (2 * MiB) // 4, bytes(2 * MiB), timeout_ms=3000)), daemon=True)
        t.start()
        time.sleep(0.5)
        res = coll_outcomes("while-stuck", 2, MiB // 4)
        exhausted("a 3 MiB window while 6 MiB are pinned", "--max-inflight-bytes",
                  (res[0].name, res[0].message))
        t.join(10)
        P.expect(stuck_out and stuck_out[0].name == "DEADLINE_EXCEEDED" and
                 P.names_rank(stuck_out[0].message, 1),
                 "the stuck collective: want DEADLINE_EXCEEDED naming rank 1, got %s" % stuck_out)
        for m in stuck:
            m.leave()
        time.sleep(0.2)
        st = P.Conn(d.addr).status()
        P.expect(not [c for c in st.collectives if c.job == "stuck"],
                 "the timed-out collective is still held after its job ended: %s" %
                 [c for c in st.collectives if c.job == "stuck"])
        res = coll_outcomes("after-stuck", 2, MiB // 4)
        P.expect(all(x.code == 0 for x in res), "after the stuck collective's timeout, a 3 MiB "
                 "window is still refused: %s" % res)
        still_serving("--max-inflight-bytes (pinned by a stuck collective)")

        P.expect(d.stop() == 0, "paramsyncd did not exit 0 on SIGTERM")
    P.done()


if __name__ == "__main__":
    main()
