"""Scrapes an embedded paramsyncd before, during and after a real workload: every
scrape passes `promtool check metrics`, and the counters equal the work done
(exactly K float32 all_reduces of B bytes by N ranks)."""

import os
import subprocess
import threading
import time

import harness as h

N, K, COUNT = 3, 40, 1024
B = COUNT * 4  # payload bytes per rank per all_reduce


def settle(d, name, want, timeout=5, **labels):
    """Scrapes until the series reaches want (the hub may count a rank's
    collective just after that rank sees its status); it must never pass it."""
    deadline = time.time() + timeout
    while True:
        s = h.parse(d.scrape())
        got = h.value(s, name, **labels) or 0
        if got > want:
            h.fail(f"{name}{labels} went past {want}: {got}")
        if got == want or time.time() > deadline:
            return s
        time.sleep(0.05)


def main():
    args = h.parse_args()
    promtool = h.need_tool("promtool")
    wd = h.Workdir("workload")
    stubs = h.make_stubs(args.proto_dir, wd.path)
    version = subprocess.run([args.paramsyncd, "--version"], capture_output=True,
                             text=True).stdout.split()[-1]
    d = h.Daemon(args.paramsyncd, wd, "embedded")
    workers = []
    try:
        text = d.scrape()
        h.promtool_check(promtool, text, "an idle daemon")
        s = h.parse(text)
        info = [dict(l) for (n, l) in s if n == "paramsync_build_info"]
        h.check(len(info) == 1, f"one paramsync_build_info series, not {info}")
        h.expect_equal("build_info version", info[0]["version"], version)
        h.expect_equal("build_info role", info[0]["role"], "embedded")
        h.check(info[0]["simd"] in ("scalar", "avx2", "avx512"), f"build_info simd {info[0]}")
        h.check(info[0]["cuda"] in ("true", "false"), f"build_info cuda {info[0]}")
        h.expect_equal("build_info value", h.value(s, "paramsync_build_info", **info[0]), 1)
        h.expect_equal("jobs before", h.value(s, "paramsync_jobs"), 0)

        hold = wd.file("go")
        workers = [h.Worker(stubs, d.addr, "wl", N, r, iters=K, count=COUNT, hold_file=hold,
                            log_dir=wd.path) for r in range(N)]
        for w in workers:
            w.wait_line("READY")
        for w in workers:
            w.wait_line("HALF")
        # Mid-run: every rank has done K/2 all_reduces and waits for us.
        s = settle(d, "paramsync_collectives_total", N * K // 2, kind="all_reduce", code="OK")
        text = d.scrape()
        h.promtool_check(promtool, text, "a daemon in the middle of a job")
        s = h.parse(text)
        h.expect_equal("all_reduces at half time",
                       h.value(s, "paramsync_collectives_total", kind="all_reduce", code="OK"),
                       N * K // 2)
        h.expect_equal("jobs while running", h.value(s, "paramsync_jobs"), 1)
        h.expect_equal("members while running", h.value(s, "paramsync_members"), N)
        h.expect_equal("agents", h.value(s, "paramsync_agents"), 1)

        # The second half runs while we scrape as fast as we can.
        stop = threading.Event()
        problems = []
        scrapes = [0]

        def scraper():
            last = -1
            while not stop.is_set():
                try:
                    t = d.scrape()
                    r = subprocess.run([promtool, "check", "metrics"], input=t,
                                       capture_output=True, text=True)
                    if r.returncode != 0:
                        problems.append(f"promtool: {r.stdout}{r.stderr}")
                    v = h.value(h.parse(t), "paramsync_collectives_total", kind="all_reduce",
                                code="OK")
                    if v < last:
                        problems.append(f"counter went down: {last} -> {v}")
                    last = v
                    scrapes[0] += 1
                except Exception as e:  # reported below, the test fails
                    problems.append(repr(e))

        t = threading.Thread(target=scraper)
        t.start()
        open(hold, "w").close()
        for w in workers:
            w.finish()
        stop.set()
        t.join()
        h.check(not problems, f"scrapes during the workload: {problems[:3]}")
        h.log(f"ok: {scrapes[0]} scrapes during the second half passed promtool, monotonic")

        s = settle(d, "paramsync_collectives_total", N * K, kind="all_reduce", code="OK")
        text = d.scrape()
        h.promtool_check(promtool, text, "the daemon after the job")
        s = h.parse(text)
        print(text, flush=True)
        E = h.expect_equal
        E("all_reduces completed", h.value(s, "paramsync_collectives_total", kind="all_reduce",
                                           code="OK"), N * K)
        E("collectives failed", h.total(s, "paramsync_collectives_total") -
          h.total(s, "paramsync_collectives_total", code="OK"), 0)
        E("duration observations", h.value(s, "paramsync_collective_duration_seconds_count",
                                            kind="all_reduce"), N * K)
        E("duration +Inf bucket", h.value(s, "paramsync_collective_duration_seconds_bucket",
                                           kind="all_reduce", le="+Inf"), N * K)
        E("arrival skew observations", h.value(s, "paramsync_arrival_skew_seconds_count",
                                                kind="all_reduce"), K)
        E("last-arriving rank counts", h.total(s, "paramsync_straggler_total"), K)
        E("payload bytes from workers", h.value(s, "paramsync_payload_bytes_total",
                                                direction="received", link="worker"), N * K * B)
        E("payload bytes to workers", h.value(s, "paramsync_payload_bytes_total",
                                              direction="sent", link="worker"), N * K * B)
        E("payload bytes between agents", h.total(s, "paramsync_payload_bytes_total",
                                                  link="agent"), 0)
        E("bytes reduced on cpu", h.value(s, "paramsync_reduced_bytes_total", device="cpu"),
          N * K * B)
        E("bytes reduced on cuda", h.value(s, "paramsync_reduced_bytes_total", device="cuda"), 0)
        E("in flight after the job", h.value(s, "paramsync_collectives_in_flight"), 0)
        for ev in ("timeouts", "mismatches", "auth_failures", "rejected_requests",
                   "ranks_lost", "ranks_stopped"):
            E(ev, h.value(s, f"paramsync_{ev}_total"), 0)
        E("Worker/Collective calls OK", h.value(s, "paramsync_grpc_calls_total",
                                                service="paramsync.v1.Worker",
                                                method="Collective", code="OK"), N * K)
        E("Worker/Collective calls", h.total(s, "paramsync_grpc_calls_total",
                                             service="paramsync.v1.Worker",
                                             method="Collective"), N * K)
        E("Worker/Leave calls OK", h.value(s, "paramsync_grpc_calls_total",
                                           service="paramsync.v1.Worker", method="Leave",
                                           code="OK"), N)
        E("Worker/Join calls", h.total(s, "paramsync_grpc_calls_total",
                                       service="paramsync.v1.Worker", method="Join"), N)
        E("jobs after leaving", h.value(s, "paramsync_jobs"), 0)
        E("members after leaving", h.value(s, "paramsync_members"), 0)
        status = d.stop()
        h.check(status == 0, f"paramsyncd exited {status} after SIGTERM")
    except BaseException:
        for w in workers:
            w.kill()
        d.kill()
        print(f"daemon log:\n{d.text()}\n(files kept in {wd.path})")
        raise
    wd.cleanup()
    h.finish()


if __name__ == "__main__":
    main()
