#!/usr/bin/env python3
"""Bounded soak: 4 jobs of 4 ranks run mixed collectives against one paramsyncd.

    soak.py --paramsyncd PATH --worker PATH [--seconds N] [--jobs J] [--ranks R] [--seed S]

Every rank is a soak_worker process (the C client): mixed collectives of
random sizes and dtypes, each result checked against a locally computed
reference (tests/soak/soak_worker.c). The test fails on any error, any wrong
element, any worker that does not finish, or daemon memory that grows after
warm-up:

  warm-up   the first max(10 s, 25% of the run); its peak RSS is the baseline
  bound     RSS at the end of the run, and once every worker has left, must
            stay within baseline + max(PARAMSYNC_SOAK_RSS_DRIFT_MB (64), 10%)

RSS here is the daemon's own memory: VmRSS less RssShmem, the workers'
shared segments as far as the agent has touched them through its mappings.
Those pages are the workers' (they go when the workers do, and grow only up
to the segments' sizes as random sizes touch more of them), so they are
printed beside it (shm) but not bounded: counted in, their slow first touch
reads as growth.

Seconds: --seconds, else PARAMSYNC_SOAK_SECONDS, else 60 (CI); run longer by
hand (PARAMSYNC_SOAK_SECONDS=3600). Prints the daemon's own RSS (with RssShmem
beside), threads and descriptors over time. Standard library only. Exit 0 PASS, 1 FAIL.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def proc_status(pid):
    """(own RSS KiB: VmRSS less RssShmem, threads, open descriptors, RssShmem
    KiB) of a live process."""
    rss = threads = -1
    shmem = 0
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("RssShmem:"):
                shmem = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    try:
        fds = len(os.listdir("/proc/%d/fd" % pid))
    except OSError:
        fds = -1
    return rss - shmem if rss >= 0 else rss, threads, fds, shmem


def sanitized(pid, binary):
    """True when the daemon runs under AddressSanitizer (gcc's libasan, or
    clang's static runtime): its quarantine makes RSS meaningless, and
    LeakSanitizer checks for leaks at exit instead."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            if "libasan" in f.read():
                return True
        with open(binary, "rb") as f:
            return b"AddressSanitizer" in f.read()
    except OSError:
        return False


def mib(kib):
    return kib / 1024.0


def slope_mib_per_min(samples):
    """Least-squares slope of (t, rss KiB) samples, in MiB per minute."""
    if len(samples) < 3:
        return 0.0
    n = float(len(samples))
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    if den == 0:
        return 0.0
    return sum((t - mt) * (r - mr) for t, r in samples) / den * 60.0 / 1024.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paramsyncd", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--seconds", type=int,
                    default=int(os.environ.get("PARAMSYNC_SOAK_SECONDS", "60")))
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seed", type=int,
                    default=int(os.environ.get("PARAMSYNC_SOAK_SEED", "12345")))
    args = ap.parse_args()
    drift_mb = float(os.environ.get("PARAMSYNC_SOAK_RSS_DRIFT_MB", "64"))
    workdir = tempfile.mkdtemp(prefix="ps-soak-")
    failures = []

    def fail(msg):
        print("FAIL: " + msg, flush=True)
        failures.append(msg)

    help_text = subprocess.run([args.paramsyncd, "--help"], capture_output=True,
                               text=True).stdout
    dargs = [args.paramsyncd, "--listen", "127.0.0.1:0", "--log-level", "warn"]
    if "--metrics-addr" in help_text:
        dargs += ["--metrics-addr", "off"]
    dlog_path = os.path.join(workdir, "paramsyncd.log")
    dlog = open(dlog_path, "w")
    daemon = subprocess.Popen(dargs, stderr=subprocess.PIPE, text=True)
    addr = None
    for line in daemon.stderr:
        dlog.write(line)
        m = re.search(r"listening on (\S+)", line)
        if m:
            addr = m.group(1)
            break
    if not addr:
        print("FAIL: paramsyncd did not start: see %s" % dlog_path)
        return 1

    def pump():
        for line in daemon.stderr:
            dlog.write(line)
            dlog.flush()

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    idle = proc_status(daemon.pid)
    asan = sanitized(daemon.pid, args.paramsyncd)
    print("soak: paramsyncd %s at %s, %d jobs x %d ranks, %d s, seed %d, logs in %s"
          % (daemon.pid, addr, args.jobs, args.ranks, args.seconds, args.seed, workdir),
          flush=True)
    print("soak: idle daemon: RSS %.1f MiB, %d threads, %d fds" % (mib(idle[0]), idle[1],
                                                                  idle[2]), flush=True)

    workers = []
    t0 = time.monotonic()
    for j in range(args.jobs):
        for r in range(args.ranks):
            name = "soak-%d-r%d" % (j, r)
            out = open(os.path.join(workdir, name + ".log"), "w")
            p = subprocess.Popen([args.worker, addr, "soak-%d" % j, str(r), str(args.ranks),
                                  str(args.seconds), str(args.seed)],
                                 stdout=out, stderr=subprocess.STDOUT)
            workers.append((name, p, out))

    warmup = max(10.0, 0.25 * args.seconds)
    samples = []  # (t, rss KiB, threads, fds) while workers run
    last_print = 0.0
    hard_end = t0 + args.seconds + 240
    while any(p.poll() is None for _, p, _ in workers):
        now = time.monotonic()
        if daemon.poll() is not None:
            fail("paramsyncd exited with %s during the soak" % daemon.returncode)
            break
        if now > hard_end:
            fail("workers still running %d s after the soak should have ended"
                 % (now - t0 - args.seconds))
            break
        rss, threads, fds, shmem = proc_status(daemon.pid)
        samples.append((now - t0, rss, threads, fds))
        if now - last_print >= 10:
            last_print = now
            print("soak: t=%5.0fs RSS %7.1f MiB (shm %7.1f)  threads %4d  fds %4d"
                  % (now - t0, mib(rss), mib(shmem), threads, fds), flush=True)
        time.sleep(0.5)
    for name, p, out in workers:
        if p.poll() is None:
            p.kill()
        p.wait()
        out.close()

    # The workers' verdicts.
    ncoll = 0
    mbytes = 0.0
    for name, p, _ in workers:
        with open(os.path.join(workdir, name + ".log")) as f:
            text = f.read()
        m = re.search(r"(\d+) iterations, (\d+) collectives, ([\d.]+) MiB", text)
        if p.returncode != 0 or not m:
            fail("%s exited %s:\n%s" % (name, p.returncode, text[-2000:]))
        else:
            ncoll += int(m.group(2))
            mbytes += float(m.group(3))
    run_s = time.monotonic() - t0

    # Memory after every worker has left (their jobs end with them).
    time.sleep(2)
    after = proc_status(daemon.pid) if daemon.poll() is None else (-1, -1, -1, 0)

    # Steady state: after warm-up, up to when the workers start to stop.
    warm = [s for s in samples if s[0] <= warmup]
    steady = [s for s in samples if warmup < s[0] <= args.seconds]
    if not warm or not steady:
        fail("too few RSS samples (%d in warm-up, %d after)" % (len(warm), len(steady)))
    else:
        base = max(s[1] for s in warm)
        last = sorted(s[1] for s in steady[-10:])  # the last 5 s under load
        end = last[len(last) // 2]
        peak = max(s[1] for s in steady)
        bound = base + max(drift_mb * 1024, 0.10 * base)
        slope = slope_mib_per_min([(s[0], s[1]) for s in steady])
        print("soak: RSS warm-up peak %.1f MiB, steady peak %.1f, end %.1f, after all left "
              "%.1f (bound %.1f); slope after warm-up %+.2f MiB/min"
              % (mib(base), mib(peak), mib(end), mib(after[0]), mib(bound), slope), flush=True)
        print("soak: threads idle %d, end of warm-up %d, end %d, after all left %d; "
              "fds idle %d, end %d, after all left %d"
              % (idle[1], warm[-1][2], steady[-1][2], after[1], idle[2], steady[-1][3],
                 after[2]), flush=True)
        if asan:
            print("soak: RSS bound not applied: paramsyncd runs under AddressSanitizer, whose "
                  "quarantine holds freed memory; LeakSanitizer checks for leaks at its exit",
                  flush=True)
        elif end > bound:
            fail("daemon RSS grew from %.1f MiB (warm-up peak) to %.1f MiB at the end: over "
                 "the bound of %.1f MiB" % (mib(base), mib(end), mib(bound)))
        if not asan and after[0] > bound:
            fail("daemon RSS %.1f MiB after every worker left: over the bound of %.1f MiB"
                 % (mib(after[0]), mib(bound)))
    print("soak: %d collectives verified, %.0f MiB moved, in %.0f s (%.0f collectives/s)"
          % (ncoll, mbytes, run_s, ncoll / run_s if run_s else 0), flush=True)

    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            rc = daemon.wait(timeout=60 if asan else 15)
            if rc != 0:
                fail("paramsyncd exited %d on SIGTERM%s" % (
                    rc, " (LeakSanitizer reports leaks with exit 23)" if asan else ""))
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            fail("paramsyncd did not exit within 15 s of SIGTERM")
    pumper.join(10)  # the daemon's stderr ends when it exits
    dlog.close()
    with open(dlog_path) as f:
        text = f.read()
    warnings = [ln for ln in text.splitlines() if " warn " in ln or " error " in ln]
    if "LeakSanitizer" in text or "AddressSanitizer" in text:
        fail("the daemon's sanitizer reported:\n" + text[text.find("=="):][:6000])
    if warnings:
        print("soak: the daemon logged %d warnings/errors; first: %s"
              % (len(warnings), warnings[0].rstrip()), flush=True)
    if failures:
        print("FAILED: %d problem(s); logs in %s" % (len(failures), workdir), flush=True)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)  # kept (and named above) only on failure
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
