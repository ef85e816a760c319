"""Shared by the client tests: a real paramsyncd per test, worker processes, skips.

Exit status 77 means SKIPPED for ctest (SKIP_RETURN_CODE 77); a test prints
why before it skips.
"""
import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77


def skip(reason):
    print("SKIPPED: " + reason, flush=True)
    sys.exit(SKIP)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def scratch(prefix):
    """A temporary folder for a test's own files (scripts, sockets, rendezvous
    files; daemon logs go with each Daemon), removed when the test exits."""
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, True)
    return d


class Daemon:
    """A paramsyncd on a free loopback port (or the given --listen), stopped on exit.
    With metrics=True it serves /metrics on a free loopback port too (metrics_url)."""

    def __init__(self, binary, *extra, listen="127.0.0.1:0", announce=None, env=None,
                 metrics=False, wrap=()):
        self.tmp = tempfile.mkdtemp(prefix="ps-client-test-")
        self.announce = announce or os.path.join(self.tmp, "addr")
        self.log_path = os.path.join(self.tmp, "paramsyncd.log")
        self.log = open(self.log_path, "wb")
        self.metrics = metrics
        self.metrics_url = None
        args = [binary, "--metrics-addr", "127.0.0.1:0" if metrics else "off",
                "--announce-file", self.announce]
        if listen is not None:
            args += ["--listen", listen]
        self.proc = subprocess.Popen(list(wrap) + args + list(extra), stdout=self.log,
                                     stderr=self.log,
                                     stdin=subprocess.DEVNULL, env=env)
        self.addr = None

    def wait_ready(self, timeout=30):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                fail("paramsyncd exited with %d at start:\n%s" % (self.proc.returncode,
                                                                 self.read_log()))
            try:
                with open(self.announce) as f:
                    text = f.read()
                if text.endswith("\n"):
                    self.addr = text.strip()
            except FileNotFoundError:
                pass
            if self.metrics and self.metrics_url is None:
                m = re.search(r"^paramsyncd: metrics on (http://\S+)$", self.read_log(), re.M)
                self.metrics_url = m.group(1) if m else None
            if self.addr and (self.metrics_url or not self.metrics):
                return self.addr
            time.sleep(0.02)
        fail("paramsyncd did not announce its address within %d s" % timeout)

    def read_log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        self.stop()


@contextlib.contextmanager
def agents(binary, n=2, coord_args=(), agent_args=(), metrics=False):
    """A coordinator and n agents of it (Daemons, ready), as hosts of a multi-agent job
    would have; yields the agents and stops them all, the coordinator last."""
    coord = Daemon(binary, "--role", "coordinator", *coord_args)
    started = []
    try:
        coord.wait_ready()
        for _ in range(n):
            started.append(Daemon(binary, "--role", "agent", "--coordinator", coord.addr,
                                  *agent_args, metrics=metrics))
            started[-1].wait_ready()
        yield started
    finally:
        for d in started + [coord]:
            d.stop()


def run_workers(cmds, envs, timeout=120, pids=None):
    """Starts one process per (cmd, env); returns [(rc, stdout, stderr)] in order.
    A process still running at the deadline is killed and gets rc None. The
    processes' ids are appended to `pids` when given."""
    procs = []
    for cmd, env in zip(cmds, envs):
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL))
        if pids is not None:
            pids.append(procs[-1].pid)
    end = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, end - time.monotonic()))
            out.append((p.returncode, o.decode(errors="replace"), e.decode(errors="replace")))
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            out.append((None, o.decode(errors="replace"), e.decode(errors="replace")))
    return out


def clean_env(**extra):
    """The environment for a worker: ours, minus anything that would point it elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PARAMSYNC_ADDR", "PARAMSYNC_JOB", "MASTER_ADDR", "MASTER_PORT", "RANK",
                        "WORLD_SIZE", "LOCAL_RANK", "PARAMSYNC_TIMEOUT_MS",
                        "PARAMSYNC_JOIN_TIMEOUT_MS", "PARAMSYNC_TOKEN")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def scrape(url):
    """The daemon's /metrics as {"name{labels}": value}."""
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def payload_bytes(url):
    """(received, sent) tensor payload bytes between workers and the agent at `url`."""
    m = scrape(url)
    return (int(m['paramsync_payload_bytes_total{direction="received",link="worker"}']),
            int(m['paramsync_payload_bytes_total{direction="sent",link="worker"}']))


def shm_names(pids):
    """The names in /dev/shm made by the paramsync clients of these processes
    (the clients name segments /paramsync.PID.N.X)."""
    prefixes = tuple("paramsync.%d." % p for p in pids)
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
    except FileNotFoundError:
        return []
