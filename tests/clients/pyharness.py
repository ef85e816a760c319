"""Shared by the client tests: a real paramsyncd per test, worker processes, skips.

Exit status 77 means SKIPPED for ctest (SKIP_RETURN_CODE 77); a test prints
why before it skips.
"""
import os
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


class Daemon:
    """A paramsyncd on a free loopback port (or the given --listen), stopped on exit."""

    def __init__(self, binary, *extra, listen="127.0.0.1:0", announce=None, env=None):
        self.tmp = tempfile.mkdtemp(prefix="ps-client-test-")
        self.announce = announce or os.path.join(self.tmp, "addr")
        self.log_path = os.path.join(self.tmp, "paramsyncd.log")
        self.log = open(self.log_path, "wb")
        args = [binary, "--metrics-addr", "off", "--announce-file", self.announce]
        if listen is not None:
            args += ["--listen", listen]
        self.proc = subprocess.Popen(args + list(extra), stdout=self.log, stderr=self.log,
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
                    return self.addr
            except FileNotFoundError:
                pass
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


def run_workers(cmds, envs, timeout=120):
    """Starts one process per (cmd, env); returns [(rc, stdout, stderr)] in order.
    A process still running at the deadline is killed and gets rc None."""
    procs = []
    for cmd, env in zip(cmds, envs):
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL))
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
