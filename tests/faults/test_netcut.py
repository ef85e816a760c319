#!/usr/bin/python3
"""A network cut between two agents, with hosts as network namespaces.

tests/netns/hosts.sh makes three hosts h0, h1, h2 (a veth each, on a bridge):
the coordinator and an agent on h0, an agent on h1 and on h2, every daemon
with --liveness-timeout-ms 2000. Job "cut": rank 0 on h1 (its agent is the
hub), rank 1 on h2. While rank 1 is sending a 64 MiB all_reduce, h2's link
goes down (the cable pulled: no FIN, no RST, the packets just stop):
  * rank 0 (on the hub side) must get ABORTED or UNAVAILABLE naming rank 1
    within 2x the liveness timeout;
  * rank 1 (cut off with its agent) must get an error within that bound too.
The link comes back; a new job over h1 and h2 must all_reduce correctly
(agents reconnect on their own; nothing is restarted).

SKIPPED (77) where network namespaces cannot be made or hosts.sh is absent.
"""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

LIVENESS_MS = 2000
BOUND_S = 2 * LIVENESS_MS / 1000.0
BIG = 16 << 20
RECOVER_S = 30
HOSTS = os.path.join(P.REPO, "tests", "netns", "hosts.sh")


def sh(*args, check=True):
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode != 0:
        P.fail("%s: exit %d: %s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r


def main():
    binary = P.paramsyncd_path()
    if not os.path.exists(HOSTS):
        P.skip("tests/netns/hosts.sh (the network namespace harness) is not in this tree")
    r = sh(HOSTS, "check", check=False)
    if r.returncode == 77:
        P.skip("network namespaces: " + (r.stdout + r.stderr).strip())
    if r.returncode != 0:
        P.fail("hosts.sh check: exit %d: %s%s" % (r.returncode, r.stdout, r.stderr))
    r = sh(HOSTS, "up", "3", check=False)
    if r.returncode == 77:
        P.skip("network namespaces: " + (r.stdout + r.stderr).strip())
    if r.returncode != 0 or "PS_NETNS=" not in r.stdout:
        P.fail("hosts.sh up 3: exit %d: %s%s" % (r.returncode, r.stdout, r.stderr))
    state = r.stdout.strip().split("PS_NETNS=", 1)[1].strip()
    hs = [HOSTS, "-s", state]
    try:
        with P.Cleanup() as cl:
            sh(*hs, "paramsyncd", binary, "--liveness-timeout-ms", str(LIVENESS_MS),
               "--metrics-addr", "off")
            ns = {h: sh(*hs, "ns", h).stdout.strip() for h in ("h0", "h1", "h2")}
            agent = {h: sh(*hs, "agent", h).stdout.strip() for h in ("h0", "h1", "h2")}
            coord = sh(*hs, "coordinator").stdout.strip()

            def worker(host, spec):
                spec = dict(spec, addr=agent[host])
                return cl.add(P.WorkerProc(spec, prefix=["ip", "netns", "exec", ns[host]],
                                           name="%s/r%s@%s" % (spec["job"], spec["rank"], host)))

            # Every agent registered (asked from h0, where the coordinator is).
            st = subprocess.run(["ip", "netns", "exec", ns["h0"], sys.executable, "-c",
                                 "import sys; sys.path.insert(0, %r); import psworker as P; "
                                 "P.wait_registered(P.Conn(%r), %r); print('ok')" %
                                 (P.HERE, coord, list(agent.values()))],
                                capture_output=True, text=True, timeout=60)
            P.check("ok" in st.stdout, "agents did not register: %s%s" % (st.stdout, st.stderr))

            big = {"do": "collective", "count": BIG, "raw": True}
            hold = {"do": "wait_join_end", "s": BOUND_S + 6}
            w0 = worker("h1", {"job": "cut", "world": 2, "rank": 0, "steps": [big, hold]})
            w1 = worker("h2", {"job": "cut", "world": 2, "rank": 1,
                               "steps": [dict(big, slow_s=0.05, announce_after=8 << 20), hold]})
            for w in (w0, w1):
                P.check(w.wait("ready", 30) is not None, "no READY: " + w.describe())
            P.check(w0.wait("ready", 1)["hub"] == agent["h1"], "the hub is not h1's agent: " +
                    w0.describe())
            P.check(w1.wait("sending", 30) is not None, "rank 1 never got 8 MiB out: " +
                    w1.describe())
            time.sleep(0.2)
            P.check(not w0.events("coll"), "the collective ended before the cut: " +
                    w0.describe())
            t_cut = time.monotonic()
            sh(*hs, "link", "h2", "down")
            P.log("h2's link is down")
            for w, rank_named in ((w0, 1), (w1, None)):
                ev = w.wait("coll", BOUND_S + 8)
                P.expect(ev is not None, "%s: no answer within %.1fs of the cut: %s" %
                         (w.name, BOUND_S + 8, w.describe()))
                if ev is None:
                    continue
                dt = ev["t"] - t_cut
                P.log("%s: %s %r, %.2fs after the cut" % (w.name, ev["code"], ev["message"], dt))
                P.expect(ev["code"] in ("ABORTED", "UNAVAILABLE"),
                         "%s: got %s %r, want ABORTED or UNAVAILABLE" %
                         (w.name, ev["code"], ev["message"]))
                if rank_named is not None:
                    P.expect(P.names_rank(ev["message"], rank_named),
                             "%s: the error does not name rank %d: %r" %
                             (w.name, rank_named, ev["message"]))
                P.expect(dt <= BOUND_S, "%s: the error came %.2fs after the cut (bound %.1fs)" %
                         (w.name, dt, BOUND_S))
            # Keep the link down a little past the bound, as a real outage would be.
            time.sleep(max(0.0, t_cut + BOUND_S + 1 - time.monotonic()))
            sh(*hs, "link", "h2", "up")
            t_up = time.monotonic()
            P.log("h2's link is up again")
            for w in (w0, w1):
                w.kill()

            # Recovery: a new job over h1 and h2 (and the same job id formed anew).
            ok = {"do": "collective", "count": 100000, "verify": True}
            deadline = t_up + RECOVER_S
            attempt = 0
            while True:
                attempt += 1
                job = "after-cut-%d" % attempt
                ws = [worker(h, {"job": job, "world": 3, "rank": r, "join_wait_s": 10,
                                 "steps": [ok, {"do": "leave"}]})
                      for r, h in enumerate(("h2", "h1", "h0"))]
                good = True
                for w in ws:
                    ev = w.wait("coll", 20)
                    good = good and ev is not None and ev["code"] == "OK" and ev["verified"]
                if good:
                    break
                for w in ws:
                    w.kill()
                if time.monotonic() > deadline:
                    P.expect(False, "no job over h1 and h2 worked within %ds of the link's "
                             "return; the last try: %s" %
                             (RECOVER_S, "\n".join(w.describe() for w in ws)))
                    break
                time.sleep(1)
            if good:
                P.log("after the link returned, job %s (hub on h2) all_reduced correctly "
                      "%.2fs later (attempt %d)" % (job, time.monotonic() - t_up, attempt))
    finally:
        sh(*hs, "down", check=False)
    P.done()


if __name__ == "__main__":
    main()
