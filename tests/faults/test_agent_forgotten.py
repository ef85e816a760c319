#!/usr/bin/python3
"""An agent that dies without a word (SIGKILL, its node gone) is no longer listed by
the coordinator once it has missed 3 of its refreshes (it registers again every
--liveness-timeout-ms), while a live agent stays listed; when a new agent comes up
at the dead one's address it is listed again. `paramsync status` would otherwise ask
the dead agent for ever, and paramsync_agents would count it.
"""
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psworker as P  # noqa: E402

LIVENESS_MS = 1000  # refresh every 1 s: forgotten after 3 s without one


def listed(addr):
    conn = P.Conn(addr)  # a fresh channel: an idle one may have been closed meanwhile
    try:
        return list(conn.status().agents)
    finally:
        conn.close()


def gauge(d):
    m = re.search(r"^paramsync_agents (\d+)$", d.metrics(), re.M)
    return int(m.group(1)) if m else None


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-faults-forgotten-")
    with P.Cleanup() as cl:
        # The agents' liveness timeout sets how often they register again.
        coord, (live, dead) = P.cluster(cl, binary, work, 2, metrics=True,
                                        agent_args=["--liveness-timeout-ms", str(LIVENESS_MS)])
        P.wait_registered(P.Conn(coord.addr), [live.addr, dead.addr])
        # Several refresh periods later both are still there: the refreshes keep them.
        time.sleep(4 * LIVENESS_MS / 1000)
        now = listed(coord.addr)
        P.expect(sorted(now) == sorted([live.addr, dead.addr]),
                 "both agents should stay listed while they refresh: %s" % now)
        P.expect(gauge(coord) == 2, "paramsync_agents should be 2: %s" % gauge(coord))

        t = time.monotonic()
        dead.kill()
        while dead.addr in listed(coord.addr) and time.monotonic() - t < 10:
            time.sleep(0.1)
        dt = time.monotonic() - t
        now = listed(coord.addr)
        P.log("the killed agent was forgotten %.2fs after SIGKILL; listed: %s" % (dt, now))
        P.expect(now == [live.addr], "only the live agent should be listed %.1fs after the "
                 "other was killed: %s" % (dt, now))
        P.expect(dt <= 3 * LIVENESS_MS / 1000 + 2.5,
                 "the killed agent was listed for %.2fs (3 refreshes of %d ms)"
                 % (dt, LIVENESS_MS))
        P.expect(gauge(coord) == 1, "paramsync_agents should be 1: %s" % gauge(coord))
        P.expect("agent at %s has not registered again" % dead.addr in coord.log_text(),
                 "the coordinator should log that it forgot %s:\n%s"
                 % (dead.addr, coord.log_text()[-2000:]))

        # An agent started again at the same address is listed again.
        dead.start()
        P.wait_registered(P.Conn(coord.addr), [live.addr, dead.addr])
    P.done()


if __name__ == "__main__":
    main()
