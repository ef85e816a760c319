#!/usr/bin/python3
"""Per-job tokens (--tokens-file): who gets in, who is refused, and what leaks.

Tokens file: jobA -> TA, jobB -> TB, '*' -> TS (any other job). Jobs jobA and
jobB are formed by ranks with the right tokens. Then, for jobA and for jobB,
callers with no token, a wrong token, the other job's token and the '*'
token try every Worker call: Join (as rank 0 and as any rank), Leave of
rank 0, NewGroup, and a Collective posing as rank 0 of seq 0 with the right
incarnation and garbage data. Every one must get UNAUTHENTICATED with
"job J: missing or wrong token...", the same answer as for a job that does
not exist. The Coordinator service, which an embedded daemon serves on the
same port, must refuse them too (UNAUTHENTICATED or PERMISSION_DENIED):
DescribeJob, NewGroup, Leave and Join straight to it, no token. Afterwards
the right ranks must find their jobs undisturbed: both
still joined, the same incarnation, only the groups they made, collectives on
group 0 (seq 0, the one the intruders posed as) and on a new group correct.
A job covered only by '*' works with TS. grpc.health.v1.Health/Check needs
no token (probes). No token string appears in the
daemon's log (debug level), in /metrics or in Admin/Status, and
paramsync_auth_failures_total counts exactly the refused calls.
"""
import os
import re
import secrets
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "faults"))
import psworker as P  # noqa: E402

COUNT = 4096


def auth_failures(d):
    m = re.search(r"^paramsync_auth_failures_total(?:\{[^}]*\})? (\d+)", d.metrics(), re.M)
    P.check(m is not None, "/metrics has no paramsync_auth_failures_total")
    return int(m.group(1))


def main():
    binary = P.paramsyncd_path()
    pb, _ = P.stubs()
    grpc = P.grpc
    work = P.workdir("ps-security-tokens-")
    tok = {k: "%s-%s" % (k, secrets.token_hex(16)) for k in ("TA", "TB", "TS", "WRONG")}
    tokens_file = os.path.join(work, "tokens")
    with open(tokens_file, "w") as f:
        f.write("# job token\njobA %s\njobB %s\n* %s\n" % (tok["TA"], tok["TB"], tok["TS"]))
    with P.Cleanup() as cl:
        d = cl.add(P.Daemon(binary, work, "paramsyncd",
                            ["--tokens-file", tokens_file, "--log-level", "debug"],
                            metrics=True)).start()
        P.check(auth_failures(d) == 0, "auth failures before any call")

        jobs = {"jobA": P.join_all(d.addr, "jobA", 2, token=tok["TA"]),
                "jobB": P.join_all(d.addr, "jobB", 2, token=tok["TB"])}
        inc = {j: ms[0].incarnation for j, ms in jobs.items()}

        refusals = 0
        answers = {}

        def refused(what, job, fn):
            nonlocal refusals
            try:
                r = fn()
                if isinstance(r, P.RpcOutcome):
                    code, msg = r.name, r.message
                else:
                    code, msg = "OK", str(r)
            except grpc.RpcError as e:
                code, msg = e.code().name, e.details() or ""
            refusals += 1
            want = "job %s: missing or wrong token" % job
            P.expect(code == "UNAUTHENTICATED" and msg.startswith(want),
                     "%s: want UNAUTHENTICATED %r..., got %s %r" % (what, want, code, msg))
            answers[what] = (code, msg.replace(job, "J", 1))

        for job, others in (("jobA", ("TB", "TS")), ("jobB", ("TA", "TS"))):
            creds = [("no token", None), ("a wrong token", tok["WRONG"])] + \
                [("token " + o, tok[o]) for o in others]
            for cname, t in creds:
                conn = P.Conn(d.addr, token=t)
                for rank in (0, -1):
                    refused("%s: Join as rank %d with %s" % (job, rank, cname), job,
                            lambda: P.Member(conn).join(job, 2, rank, wait_s=10))
                refused("%s: Leave rank 0 with %s" % (job, cname), job,
                        lambda: conn.worker.Leave(pb.LeaveRequest(job=job, rank=0),
                                                  metadata=conn.md, timeout=10))
                refused("%s: NewGroup with %s" % (job, cname), job,
                        lambda: conn.worker.NewGroup(
                            pb.NewGroupRequest(job=job, group=1, ranks=[1], rank=0),
                            metadata=conn.md, timeout=10))
                refused("%s: Collective as rank 0 with %s" % (job, cname), job,
                        lambda: P.collective(conn, "ALL_REDUCE", COUNT,
                                             P.floats([666.0] * COUNT), job=job, seq=0,
                                             rank=0, incarnation=inc[job], rpc_timeout=10))
                conn.close()
        # A job that does not exist gets the very same answer.
        conn = P.Conn(d.addr, token=tok["WRONG"])
        refused("no-such-job: Join with a wrong token", "no-such-job",
                lambda: P.Member(conn).join("no-such-job", 2, 0, wait_s=10))
        conn.close()
        conn = P.Conn(d.addr)
        refused("no-such-job: Join with no token", "no-such-job",
                lambda: P.Member(conn).join("no-such-job", 2, 0, wait_s=10))
        conn.close()
        P.expect(answers["no-such-job: Join with a wrong token"] ==
                 answers["jobA: Join as rank 0 with a wrong token"] and
                 answers["no-such-job: Join with no token"] ==
                 answers["jobA: Join as rank 0 with no token"],
                 "a job that exists and one that does not get different answers: %s" %
                 {k: v for k, v in answers.items() if "Join as rank 0" in k or "no-such" in k})
        P.log("%d calls without the job's token: all UNAUTHENTICATED" % refusals)

        # The Coordinator service on the same port: the back door to the same jobs.
        _, pb_grpc = P.stubs()
        ch = grpc.insecure_channel(d.addr)
        coord = pb_grpc.CoordinatorStub(ch)
        for what, fn in (
                ("DescribeJob", lambda: coord.DescribeJob(pb.DescribeJobRequest(job="jobA"),
                                                          timeout=10)),
                ("NewGroup", lambda: coord.NewGroup(pb.NewGroupRequest(
                    job="jobA", group=1, ranks=[1], rank=0), timeout=10)),
                ("Leave", lambda: coord.Leave(pb.LeaveRequest(job="jobA", rank=0),
                                              timeout=10)),
                ("Join", lambda: next(iter(coord.Join(iter([pb.JoinRequest(
                    job="jobA", world_size=2, rank=-1)]), timeout=10))))):
            try:
                r = fn()
                code, msg = "OK", str(r).replace("\n", " ")
            except grpc.RpcError as e:
                code, msg = e.code().name, e.details() or ""
            refusals += code == "UNAUTHENTICATED"  # counted as auth failures too
            P.expect(code in ("UNAUTHENTICATED", "PERMISSION_DENIED"),
                     "Coordinator/%s on the worker port with no token: want UNAUTHENTICATED or "
                     "PERMISSION_DENIED, got %s %r" % (what, code, msg))
        ch.close()

        # The right ranks: undisturbed.
        st = P.Conn(d.addr).status()
        for job, ms in jobs.items():
            js = [j for j in st.jobs if j.job == job]
            P.check(len(js) == 1, "%s is gone after the intruders: %s" % (job, st))
            js = js[0]
            P.expect(js.incarnation == inc[job] and js.state == "running" and
                     sorted((r.rank, r.state) for r in js.ranks) == [(0, "joined"),
                                                                       (1, "joined")] and
                     len(js.groups) == 0,
                     "%s was disturbed (incarnation, state, ranks or groups): %s" % (job, js))
            for m in ms:
                P.expect(m.end is None, "%s rank %d's Join stream ended: %s" %
                         (job, m.rank, m.end))
            ng = P.in_threads([lambda m=m: m.conn.worker.NewGroup(
                pb.NewGroupRequest(job=job, group=1, ranks=[1, 0], rank=m.rank),
                metadata=m.conn.md, timeout=10) for m in ms])
            P.expect(all(isinstance(r, pb.NewGroupResponse) and r.group_size == 2 for r in ng),
                     "%s: NewGroup by its own ranks failed: %s" % (job, ng))
            # seq 0 of group 0: the collective the intruders posed as.
            res = P.in_threads([lambda m=m: m.collective("ALL_REDUCE", COUNT,
                                                         P.rank_tensor(m.rank, COUNT))
                                for m in ms])
            P.expect(all(r.code == 0 and r.data == P.sum_tensor([0, 1], COUNT) for r in res),
                     "%s: all_reduce (group 0, seq 0) of its own ranks is wrong: %s" %
                     (job, res))
            # On the new group, whose group rank 0 is job rank 1.
            res = P.in_threads([lambda m=m: m.collective(
                "ALL_REDUCE", COUNT, P.rank_tensor(1 - m.rank, COUNT), group=1,
                rank=1 - m.rank) for m in ms])
            P.expect(all(r.code == 0 and r.data == P.sum_tensor([0, 1], COUNT) for r in res),
                     "%s: all_reduce on group 1 is wrong: %s" % (job, res))
            for m in ms:
                m.leave()
        P.log("checked: jobA and jobB after the intruders (ranks, groups, collectives)")

        # '*' covers other jobs, and only them.
        P.expect(P.all_ok(P.run_ranks(d.addr, "jobC", 2, token=tok["TS"])),
                 "jobC (covered by '*') with the '*' token failed")

        # Probes need no token. The agent's part of the health follows its
        # coordinator's channel, looked at every 100 ms at first: a run this
        # fast (jobs done 60 ms after start under ASan) may ask before that,
        # so NOT_SERVING is asked again for up to 5 s; SERVING must come.
        ch = grpc.insecure_channel(d.addr)
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda x: x,
                               response_deserializer=lambda x: x)
        try:
            until = time.monotonic() + 5
            h = check(b"", timeout=10)
            while h == b"\x08\x02" and time.monotonic() < until:
                time.sleep(0.05)
                h = check(b"", timeout=10)
            P.expect(h == b"\x08\x01", "Health/Check without a token: %r, want SERVING" % h)
        except grpc.RpcError as e:
            P.expect(False, "Health/Check without a token: %s %s" % (e.code(), e.details()))
        ch.close()

        # Nothing leaks.
        n = auth_failures(d)
        P.expect(n == refusals, "paramsync_auth_failures_total is %d, want %d (the refused "
                 "calls)" % (n, refusals))
        texts = {"the daemon's log": d.log_text(), "/metrics": d.metrics(),
                 "Admin/Status": str(P.Conn(d.addr).status())}
        P.expect("missing or wrong token" in texts["the daemon's log"],
                 "the daemon's log does not record the refusals")
        for where, text in texts.items():
            for k, t in tok.items():
                P.expect(t not in text and t.split("-", 1)[1] not in text,
                         "token %s appears in %s" % (k, where))
        P.log("no token in the log (%d bytes, debug level), /metrics or Status; "
              "paramsync_auth_failures_total = %d" % (len(texts["the daemon's log"]), n))
        P.expect(d.stop() == 0, "paramsyncd did not exit 0 on SIGTERM")
    P.done()


if __name__ == "__main__":
    main()
