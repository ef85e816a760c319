"""A deliberately slow rank shows up as the last-arriving rank: in
paramsync_straggler_total and the arrival-skew histogram of the hub agent,
and in `paramsync status` (text and --json) asked of the coordinator, which
gathers in-flight collectives from its agents.

Layout: a coordinator, agent A (ranks 0 and 1; the hub, as rank 0's agent)
and agent B (rank 2, which sleeps SLOW seconds before each all_reduce)."""

import json
import re
import subprocess
import time

import harness as h

# SLOW leaves the checks below seconds of slack on a loaded machine: while
# rank 2 sleeps, the same all_reduce (seq 0) must still be in flight.
N, M, COUNT, SLOW = 3, 3, 256, 3.0
B = COUNT * 4


def main():
    args = h.parse_args()
    cli = h.need_cli(args)
    promtool = h.need_tool("promtool")
    wd = h.Workdir("straggler")
    stubs = h.make_stubs(args.proto_dir, wd.path)
    coord = h.Daemon(args.paramsyncd, wd, "coordinator", role="coordinator")
    daemons = [coord]
    workers = []
    try:
        a = h.Daemon(args.paramsyncd, wd, "agent-a", role="agent",
                     extra=["--coordinator", coord.addr])
        daemons.append(a)
        b = h.Daemon(args.paramsyncd, wd, "agent-b", role="agent",
                     extra=["--coordinator", coord.addr])
        daemons.append(b)
        at = [a, a, b]
        workers = [h.Worker(stubs, at[r].addr, "st", N, r, iters=M, count=COUNT, slow_rank=2,
                            slow_seconds=SLOW, log_dir=wd.path) for r in range(N)]
        for w in workers:
            w.wait_line("READY")
        workers[2].wait_line("SLOW 0")
        time.sleep(SLOW / 2)  # ranks 0 and 1 are in all_reduce seq 0; rank 2 sleeps

        # The hub says how long its oldest collective has waited (what ParamsyncRankLate uses).
        wait = h.value(h.parse(a.scrape()), "paramsync_collective_longest_wait_seconds")
        h.log(f"hub: paramsync_collective_longest_wait_seconds = {wait}")
        h.expect_equal("hub: longest wait exported while rank 2 sleeps", wait is not None, True)
        if wait is not None:
            h.check(0.2 <= wait <= SLOW + 5, f"longest wait {wait} for a rank {SLOW / 2} s late")

        r = subprocess.run([cli, "status", "--addr", coord.addr, "--json"], capture_output=True,
                           text=True, timeout=30)
        h.check(r.returncode == 0, f"paramsync status --json exited {r.returncode}: {r.stderr}")
        st = json.loads(r.stdout)
        h.log(f"status --json: {r.stdout.strip()}")
        h.expect_equal("role", st["daemon"]["role"], "coordinator")
        h.expect_equal("agents listed", sorted(st["agents"]), sorted([a.addr, b.addr]))
        jobs = [j for j in st["jobs"] if j["job"] == "st"]
        h.check(len(jobs) == 1, f"job st in {st['jobs']}")
        h.expect_equal("job state", jobs[0]["state"], "running")
        h.expect_equal("job hub", jobs[0]["hub"], a.addr)
        h.expect_equal("rank agents", [x["agent"] for x in jobs[0]["ranks"]],
                       [a.addr, a.addr, b.addr])
        h.expect_equal("rank states", [x["state"] for x in jobs[0]["ranks"]], ["joined"] * 3)
        # Each rank is its own process with its own connection: "where they are"
        # is the worker's address, not the agent's connection to the coordinator.
        peers = [x["peer"] for x in jobs[0]["ranks"]]
        h.expect_equal(f"distinct worker addresses for 3 worker processes {peers}",
                       len(set(peers)), 3)
        cs = [c for c in st["collectives"] if c["job"] == "st"]
        h.check(len(cs) == 1, f"one collective of job st in flight: {st['collectives']}")
        c = cs[0]
        h.expect_equal("in-flight kind", c["kind"], "all_reduce")
        # seq 0 unless the status call took longer than rank 2's sleep (seen once under
        # ASan, with the whole suite starting at once: the CLI answered 2 s after the
        # scrape, in seq 1, 0.1 s into its wait). Every seq waits for rank 2 alike.
        h.check(c["seq"] in range(M), f"in-flight seq {c['seq']} is one of the {M}")
        if c["seq"] != 0:
            h.log(f"note: status came {c['seq']} all_reduce(s) late; seq {c['seq']} checked")
        h.expect_equal("in-flight group", c["group"], 0)
        h.expect_equal("in-flight reported by", c["agent"], a.addr)
        h.expect_equal("waiting_for", c["waiting_for"], [2])
        h.expect_equal("arrived", sorted(c["arrived"]), [0, 1])
        least = 0.2 if c["seq"] == 0 else 0.0
        h.check(least <= c["waiting_seconds"] <= SLOW + 5,
                f"waiting_seconds {c['waiting_seconds']} for a rank {SLOW / 2} s late")
        h.log(f"ok: waiting {c['waiting_seconds']:.2f} s")
        h.expect_equal("errors", st["errors"], [])

        r = subprocess.run([cli, "status", "--addr", coord.addr], capture_output=True,
                           text=True, timeout=30)
        h.check(r.returncode == 0, f"paramsync status exited {r.returncode}: {r.stderr}")
        h.log(f"status:\n{r.stdout}")
        text = r.stdout
        # Asked a moment later than --json: on a slow machine seq 0 may have
        # ended and rank 2 be asleep before seq 1, which reads the same way.
        h.check(re.search(r"group 0 seq [0-2] all_reduce", text) is not None,
                "the in-flight all_reduce in the text")
        h.check("waiting" in text and "for rank 2" in text, "'waiting ... for rank 2' in the text")
        h.check("longest wait: job st all_reduce" in text, "the longest-wait line")

        for w in workers:
            w.finish()

        # The hub (agent A) saw rank 2 arrive last every time, >= SLOW after the others.
        scrape_a, scrape_b = a.scrape(), b.scrape()
        for name, text in (("hub agent A", scrape_a), ("agent B", scrape_b)):
            h.promtool_check(promtool, text, name)
            h.log(f"{name} scrape (excerpt):")
            h.show(text, "paramsync_collectives_total{kind=\"all_reduce\"",
                   "paramsync_straggler_total", "paramsync_arrival_skew_seconds_sum",
                   "paramsync_payload_bytes_total", "paramsync_reduced_bytes_total",
                   "paramsync_grpc_calls_total")
        s = h.parse(scrape_a)
        E = h.expect_equal
        E("hub: all_reduces", h.value(s, "paramsync_collectives_total", kind="all_reduce",
                                      code="OK"), N * M)
        E("hub: straggler rank 2", h.value(s, "paramsync_straggler_total", rank="2"), M)
        E("hub: straggler all ranks", h.total(s, "paramsync_straggler_total"), M)
        E("hub: skew observations", h.value(s, "paramsync_arrival_skew_seconds_count",
                                            kind="all_reduce"), M)
        E("hub: skews of 1 s or less", h.value(s, "paramsync_arrival_skew_seconds_bucket",
                                               kind="all_reduce", le="1"), 0)
        skew = h.value(s, "paramsync_arrival_skew_seconds_sum", kind="all_reduce")
        h.check(M * SLOW * 0.9 <= skew <= M * (SLOW + 3), f"skew sum {skew} for {M} x {SLOW} s")
        h.log(f"ok: skew sum {skew:.2f} s")
        E("hub: bytes from its workers", h.value(s, "paramsync_payload_bytes_total",
                                                 direction="received", link="worker"),
          2 * M * B)
        E("hub: bytes from agent B", h.value(s, "paramsync_payload_bytes_total",
                                             direction="received", link="agent"), M * B)
        E("hub: bytes to its workers", h.value(s, "paramsync_payload_bytes_total",
                                               direction="sent", link="worker"), 2 * M * B)
        E("hub: bytes to agent B", h.value(s, "paramsync_payload_bytes_total",
                                           direction="sent", link="agent"), M * B)
        E("hub: bytes reduced", h.value(s, "paramsync_reduced_bytes_total", device="cpu"),
          N * M * B)
        sb = h.parse(scrape_b)
        E("agent B: bytes from rank 2", h.value(sb, "paramsync_payload_bytes_total",
                                                direction="received", link="worker"), M * B)
        E("agent B: bytes forwarded to the hub", h.value(sb, "paramsync_payload_bytes_total",
                                                         direction="sent", link="agent"), M * B)
        E("agent B: bytes back to rank 2", h.value(sb, "paramsync_payload_bytes_total",
                                                   direction="sent", link="worker"), M * B)
        E("agent B: reduced nothing", h.value(sb, "paramsync_reduced_bytes_total",
                                              device="cpu"), 0)
        sc = h.parse(coord.scrape())
        info = [dict(l) for (n, l) in sc if n == "paramsync_build_info"]
        E("coordinator role label", info[0]["role"], "coordinator")
        E("coordinator: agents", h.value(sc, "paramsync_agents"), 2)
        E("coordinator: jobs after the job", h.value(sc, "paramsync_jobs"), 0)
        for d in reversed(daemons):
            status = d.stop()
            h.check(status == 0, f"{d.name} exited {status} after SIGTERM")
    except BaseException:
        for w in workers:
            w.kill()
        for d in daemons:
            d.kill()
            print(f"--- {d.name} log:\n{d.text()}")
        print(f"(files kept in {wd.path})")
        raise
    wd.cleanup()
    h.finish()


if __name__ == "__main__":
    main()
