#!/usr/bin/python3
"""SIGTERM with calls in flight: the daemon exits 0, promptly, and every call in
flight (a collective waiting for a rank, a 64 MiB collective mid-transfer, the
Join streams) ends with UNAVAILABLE.
"""
import os
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
        je = p.wait("join_end", 10)
        P.expect(je is not None and je["code"] == "UNAVAILABLE",
                 "%s: %s's Join stream did not end with UNAVAILABLE: %s" %
                 (name, p.name, p.describe()))


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

        def transferring(procs):
            P.check(procs[1].wait("sending", 30) is not None, procs[1].describe())
            time.sleep(0.2)

        big = {"do": "collective", "count": BIG, "raw": True}
        case(cl, binary, work, "transferring",
             {0: {"steps": [big, END]},
              1: {"steps": [dict(big, slow_s=0.05, announce_after=8 << 20), END]}},
             transferring)
    P.done()


if __name__ == "__main__":
    main()
