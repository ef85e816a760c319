"""Shared helpers of the metrics integration tests: a real paramsyncd, real workers, scrapes.

Every test is a script run by ctest as
    /usr/bin/python3 test_X.py --paramsyncd PATH --cli PATH --proto-dir DIR
and exits 0 (passed), 1 (failed) or 77 (SKIPPED, with the reason printed).
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def skip(reason):
    print(f"SKIPPED: {reason}", flush=True)
    sys.exit(SKIP)


def fail(msg):
    print(f"FAILED: {msg}", flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(extra=None):
    p = argparse.ArgumentParser()
    p.add_argument("--paramsyncd", required=True)
    p.add_argument("--cli", default="")
    p.add_argument("--proto-dir", required=True)
    p.add_argument("--source-dir", default=os.path.dirname(os.path.dirname(HERE)))
    if extra:
        extra(p)
    return p.parse_args()


def need_tool(name):
    path = shutil.which(name)
    if not path:
        skip(f"{name} is not installed (Debian package 'prometheus'; scripts/setup installs it)")
    return path


def need_cli(args):
    if not args.cli or not os.access(args.cli, os.X_OK):
        skip("the paramsync command (target paramsync_cli) is not built")
    return args.cli


class Workdir:
    """A temporary directory removed at exit unless the test failed (kept for a look)."""

    def __init__(self, name):
        self.path = tempfile.mkdtemp(prefix=f"ps-{name}-")

    def file(self, name):
        return os.path.join(self.path, name)

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- stubs


def make_stubs(proto_dir, out_dir):
    """Generates Python stubs for paramsync.v1 and grpc.health.v1 into out_dir
    and puts it on sys.path. The health proto is copied under another path
    so that its module does not shadow the grpc package (the wire names come
    from the proto package, which stays grpc.health.v1)."""
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError as e:
        skip(f"{e.name} missing for {sys.executable} (python3-grpcio, python3-protobuf)")
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    if not protoc or not os.access(plugin, os.X_OK):
        skip("protoc or grpc_python_plugin missing (protobuf-compiler, protobuf-compiler-grpc)")
    src = os.path.join(out_dir, "protos")
    os.makedirs(os.path.join(src, "paramsync", "v1"), exist_ok=True)
    os.makedirs(os.path.join(src, "pshealth"), exist_ok=True)
    shutil.copy(os.path.join(proto_dir, "paramsync", "v1", "paramsync.proto"),
                os.path.join(src, "paramsync", "v1", "paramsync.proto"))
    shutil.copy(os.path.join(proto_dir, "grpc", "health", "v1", "health.proto"),
                os.path.join(src, "pshealth", "health.proto"))
    gen = os.path.join(out_dir, "gen")
    os.makedirs(gen, exist_ok=True)
    subprocess.run([protoc, f"-I{src}", f"--python_out={gen}", f"--grpc_out={gen}",
                    f"--plugin=protoc-gen-grpc={plugin}", "paramsync/v1/paramsync.proto",
                    "pshealth/health.proto"], check=True)
    if gen not in sys.path:
        sys.path.insert(0, gen)
    return gen


# ---------------------------------------------------------------- daemon


class Daemon:
    """A paramsyncd process with its gRPC and metrics addresses."""

    def __init__(self, binary, workdir, name, role="embedded", extra=(), metrics=True, env=None,
                 port=None):
        self.name = name
        self.log_path = os.path.join(workdir.path, f"{name}.log")
        e = dict(os.environ)
        e.update(env or {})
        # free_port's port may be bound by a test beside this one before the daemon binds
        # it (the daemon then refuses to start): another port is tried.
        for tries in range(3, 0, -1):
            self.port = port or free_port()
            self.addr = f"127.0.0.1:{self.port}"
            self.metrics_url = None
            cmd = [binary, "--role", role, "--listen", self.addr, "--log-level", "info"]
            if metrics:
                cmd += ["--metrics-addr", "127.0.0.1:0"]
            else:
                cmd += ["--metrics-addr", "off"]
            cmd += list(extra)
            self.cmd = cmd
            self.log = open(self.log_path, "w+")
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
            if self._wait_started(metrics, retry=port is None and tries > 1):
                return
            self.log.close()

    def _wait_started(self, metrics, retry):
        """True once started; False when the port was in use and retry allows another."""
        deadline = time.time() + 20
        while time.time() < deadline:
            text = self.text()
            if metrics and self.metrics_url is None:
                m = re.search(r"metrics on (http://\S+/metrics)", text)
                if m:
                    self.metrics_url = m.group(1)
            if "listening on" in text and (self.metrics_url or not metrics):
                return True
            if self.proc.poll() is not None:
                if retry and f"cannot listen on {self.addr}" in text:
                    return False
                fail(f"{self.name} exited with {self.proc.returncode} at start:\n{text}")
            time.sleep(0.05)
        fail(f"{self.name} did not start within 20 s:\n{self.text()}")

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def scrape(self):
        return scrape(self.metrics_url)

    def stop(self, timeout=15):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                fail(f"{self.name} did not stop within {timeout} s of SIGTERM:\n{self.text()}")
        self.log.close()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- workers


class Worker:
    """One rank: worker.py in a process of its own, reporting progress on stdout."""

    def __init__(self, stub_dir, addr, job, world, rank, *, iters, count, slow_rank=-1,
                 slow_seconds=0.0, hold_file=None, log_dir=None):
        cmd = [sys.executable, os.path.join(HERE, "worker.py"), "--stubs", stub_dir,
               "--addr", addr, "--job", job, "--world", str(world), "--rank", str(rank),
               "--iters", str(iters), "--count", str(count), "--slow-rank", str(slow_rank),
               "--slow-seconds", str(slow_seconds)]
        if hold_file:
            cmd += ["--hold-file", hold_file]
        self.rank = rank
        self.err_path = os.path.join(log_dir, f"worker-{job}-{rank}.err") if log_dir else None
        self.err = open(self.err_path, "w") if self.err_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.lines = []

    def wait_line(self, prefix, timeout=60):
        """Reads stdout until a line starting with prefix; returns it."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                fail(f"rank {self.rank} ended before '{prefix}' (exit {self.proc.wait()}): "
                     f"{self.stderr()}")
            line = line.strip()
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        fail(f"rank {self.rank}: no '{prefix}' within {timeout} s")

    def finish(self, timeout=120):
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail(f"rank {self.rank} did not finish within {timeout} s")
        self.lines += out.splitlines()
        if self.err_path:
            self.err.close()
        check(self.proc.returncode == 0,
              f"rank {self.rank} exited {self.proc.returncode}: {self.stderr()}")
        return self.lines

    def stderr(self):
        if not self.err_path:
            return ""
        with open(self.err_path) as f:
            return f.read()[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- metrics


def scrape(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        ctype = r.headers.get("Content-Type")
        check(ctype == "text/plain; version=0.0.4", f"Content-Type of {url} is {ctype!r}")
        return r.read().decode()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse(text):
    """{(name, ((label, value), ...sorted)): float} of every sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        check(m is not None, f"malformed sample line: {line!r}")
        labels = []
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            check(lm is not None, f"malformed labels in {line!r}")
            value = lm.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            labels.append((lm.group(1), value))
            pos = lm.end()
        out[(m.group(1), tuple(sorted(labels)))] = float(m.group(4))
    return out


def value(samples, name, **labels):
    """The value of one series, or None when absent."""
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples, name, **match):
    """The sum over every series of name whose labels include match."""
    s = 0.0
    for (n, labels), v in samples.items():
        if n == name and all(dict(labels).get(k) == w for k, w in match.items()):
            s += v
    return s


def promtool_check(promtool, text, what):
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True)
    check(r.returncode == 0, f"promtool check metrics on {what}:\n{r.stdout}{r.stderr}")


_mismatches = []


def expect_equal(what, got, want):
    """Records a mismatch (the test fails at finish()) so that one run reports them all."""
    if got != want:
        _mismatches.append(f"{what}: got {got}, want {want}")
        log(f"MISMATCH: {what}: got {got}, want {want}")
    else:
        log(f"ok: {what} = {got}")


def finish():
    """Fails if any expect_equal did not hold; else prints PASSED."""
    if _mismatches:
        fail(f"{len(_mismatches)} mismatch(es):\n  " + "\n  ".join(_mismatches))
    print("PASSED", flush=True)


def show(text, *prefixes):
    """Prints the lines of a scrape that start with one of prefixes (for the record)."""
    for line in text.splitlines():
        if line.startswith(prefixes):
            print(f"    {line}", flush=True)
