#!/usr/bin/python3
"""Runs one example of examples/python/ with paramsync and, unchanged but for the
import and the backend name, with torch.distributed's Gloo backend; compares
what they print.

    seed_compare.py --python VENV_PY --paramsyncd BIN --mode MODE [--nproc N]
                    [--gloo-error RE --paramsync-error RE] [--gloo-unsupported RE
                    --expected FILE] EXAMPLE.py

Modes, by how the seed starts its processes:
  launch  N workers with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set: Gloo's
          by this script, paramsync's by `python3 -m paramsync.run --prefix`.
  spawn   one process that starts its workers itself and meets at the seed's
          127.0.0.1:29500; paramsync's daemon is a bare `paramsyncd` (whose
          default address that is).
  tcp     workers `--rank R` with init_method tcp://10.1.1.20:23456 (the
          seed's address): the daemon listens there.
  file    workers `--rank R` with init_method file:///mnt/nfs/sharedfile:
          the daemon announces itself in that file.
Fixed addresses and paths come from the seeds, so the runs happen inside a
private network and mount namespace (unshare, as root) where 10.1.1.20 is a
loopback address and /mnt is a tmpfs. Without one, `launch` runs on free ports
and the other modes are SKIPPED.

The comparison: every rank's stdout lines, sorted, must be equal, and the
run must fail under paramsync exactly when it fails under Gloo. Some seeds
are not valid torch programs (mismatched dtypes, tensors where torch takes
lists): then --gloo-error and --paramsync-error must match the two stderrs,
so both fail for the named reason. Where Gloo does not implement the
collective (--gloo-unsupported matches its error), paramsync's output is
compared with --expected instead, and the test says so.
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pyharness as H  # noqa: E402

TIMEOUT = 120
IMPORT_PS = "import paramsync.distributed as dist"
IMPORT_TORCH = "import torch.distributed as dist"


def gloo_variant(src):
    """The example with torch.distributed and "gloo": exactly two lines must change."""
    lines = src.splitlines(keepends=True)
    out = []
    changed = 0
    for line in lines:
        new = line
        if line.strip() == IMPORT_PS:
            new = line.replace(IMPORT_PS, IMPORT_TORCH)
        elif not line.lstrip().startswith("#"):
            new = re.sub(r"""(['"])paramsync\1""", r"\1gloo\1", line)
        if new != line:
            changed += 1
        out.append(new)
    if changed != 2:
        H.fail("the example must differ from its torch form in exactly two lines (the import "
               "and the backend name); %d lines mention them" % changed)
    return "".join(out)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def in_namespace():
    return os.environ.get("PS_SEED_NETNS") == "1"


def enter_namespace(argv, mode):
    """Re-runs this script inside a new network + mount namespace; returns its status,
    or None when namespaces are not available."""
    if in_namespace() or not shutil.which("unshare") or not shutil.which("ip"):
        return None
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    setup = "ip link set lo up"
    if mode == "tcp":
        setup += " && ip addr add 10.1.1.20/32 dev lo"
    if mode == "file":
        setup += " && mount -t tmpfs tmpfs /mnt && mkdir -p /mnt/nfs"
    env = dict(os.environ, PS_SEED_NETNS="1")
    cmd = ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c",
           setup + ' && exec "$@"', "sh", sys.executable, os.path.abspath(__file__)] + argv
    return subprocess.run(cmd, env=env).returncode


def worker_env(**kw):
    env = H.clean_env(**kw)
    env.pop("PYTHONUNBUFFERED", None)  # one process's lines must not be split by another's
    return env


def collect(results):
    """(all ok, sorted stdout lines, stderr text) of a list of run_workers results."""
    ok = all(rc == 0 for rc, _, _ in results)
    lines = sorted(line for _, out, _ in results for line in out.splitlines())
    err = "\n".join("[rank %d, exit %s]\n%s" % (i, rc, e.rstrip())
                    for i, (rc, _, e) in enumerate(results) if e.strip())
    return ok, lines, err


def run_gloo(a, script):
    py = a.python
    n = a.nproc
    if a.mode == "launch":
        port = 29500 if in_namespace() else free_port()
        envs = [worker_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=n, MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port) for r in range(n)]
        return collect(H.run_workers([[py, script]] * n, envs, TIMEOUT))
    if a.mode == "spawn":
        return collect(H.run_workers([[py, script]], [worker_env()], TIMEOUT))
    envs = [worker_env() for _ in range(n)]
    res = collect(H.run_workers([[py, script, "--rank", str(r)] for r in range(n)], envs,
                                TIMEOUT))
    if a.mode == "file" and os.path.exists("/mnt/nfs/sharedfile"):
        os.unlink("/mnt/nfs/sharedfile")  # torch's FileStore may leave it
    return res


def run_paramsync(a, script):
    py = a.python
    n = a.nproc
    if a.mode == "launch":
        env = worker_env(PARAMSYNC_DAEMON=a.paramsyncd)
        p = subprocess.run([py, "-m", "paramsync.run", "--nproc", str(n), "--prefix", script],
                           env=env, capture_output=True, text=True, timeout=TIMEOUT)
        lines = sorted(re.sub(r"^\[\d+\]: ", "", line) for line in p.stdout.splitlines())
        return p.returncode == 0, lines, p.stderr
    if a.mode == "spawn":
        if in_namespace():
            d = H.Daemon(a.paramsyncd, listen=None)  # no --listen: 127.0.0.1:29500
            env = worker_env()
        else:
            d = H.Daemon(a.paramsyncd)
        try:
            d.wait_ready()
            if not in_namespace():
                env = worker_env(PARAMSYNC_ADDR=d.addr)  # overrides the seed's MASTER_*
            if in_namespace() and d.addr != "127.0.0.1:29500":
                H.fail("a bare paramsyncd announced %s, not 127.0.0.1:29500" % d.addr)
            res = collect(H.run_workers([[py, script]], [env], TIMEOUT))
        finally:
            d.stop()
        return res
    if a.mode == "tcp":
        d = H.Daemon(a.paramsyncd, listen="10.1.1.20:23456")
        try:
            d.wait_ready()
            res = collect(H.run_workers([[py, script, "--rank", str(r)] for r in range(n)],
                                        [worker_env() for _ in range(n)], TIMEOUT))
        finally:
            d.stop()
        return res
    # file: the workers start first and wait for the daemon's announcement.
    procs = [subprocess.Popen([py, script, "--rank", str(r)], env=worker_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(n)]
    time.sleep(0.5)
    d = H.Daemon(a.paramsyncd, announce="/mnt/nfs/sharedfile")
    try:
        d.wait_ready()
        results = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=TIMEOUT)
                results.append((p.returncode, o.decode(), e.decode()))
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
                results.append((None, o.decode(), e.decode()))
    finally:
        d.stop()
    return collect(results)


def show(title, ok, lines, err):
    print("--- %s: %s" % (title, "all ranks exited 0" if ok else "failed"))
    for line in lines:
        print("    " + line)
    if not ok:
        tail = [ln for ln in err.splitlines() if ln.strip()][-12:]
        print("    stderr (last lines):")
        for ln in tail:
            print("      " + ln)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", required=True)
    p.add_argument("--paramsyncd", required=True)
    p.add_argument("--mode", choices=["launch", "spawn", "tcp", "file"], default="launch")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--gloo-error")
    p.add_argument("--paramsync-error")
    p.add_argument("--gloo-unsupported")
    p.add_argument("--expected")
    p.add_argument("example")
    a = p.parse_args()
    a.example = os.path.abspath(a.example)
    a.python = os.path.abspath(a.python)
    if not os.path.exists(a.python):
        H.fail("%s does not exist: the client_python_install test makes it" % a.python)
    # (find_spec, not import: importing torch costs seconds, and each run imports it anyway)
    if subprocess.run([a.python, "-c", "import importlib.util as u, sys; "
                       "sys.exit(u.find_spec('torch') is None)"]).returncode != 0:
        H.skip("torch is not installed (Debian python3-torch); no Gloo baseline to "
               "compare with")

    if not in_namespace():
        rc = enter_namespace(sys.argv[1:], a.mode)
        if rc is not None:
            sys.exit(rc)
        if a.mode != "launch":
            H.skip("the seed's fixed address needs a private network/mount namespace "
                   "(unshare --net --mount, as root) and none is available")
        print("(no network namespace: running on free ports)")

    with open(a.example) as f:
        src = f.read()
    tmp = tempfile.mkdtemp(prefix="ps-seed-")
    gloo_script = os.path.join(tmp, os.path.basename(a.example))
    with open(gloo_script, "w") as f:
        f.write(gloo_variant(src))

    g_ok, g_lines, g_err = run_gloo(a, gloo_script)
    p_ok, p_lines, p_err = run_paramsync(a, a.example)
    shutil.rmtree(tmp, ignore_errors=True)
    show("torch.distributed, gloo", g_ok, g_lines, g_err)
    show("paramsync", p_ok, p_lines, p_err)

    if a.gloo_unsupported:
        if g_ok or not re.search(a.gloo_unsupported, g_err):
            H.fail("expected Gloo to fail with /%s/ (it does not implement this collective)"
                   % a.gloo_unsupported)
        with open(a.expected) as f:
            want = sorted(f.read().splitlines())
        if not p_ok or p_lines != want:
            H.fail("Gloo cannot run this; paramsync's output must then be %s:\n  %s"
                   % (a.expected, "\n  ".join(want)))
        print("PASS (Gloo does not implement it; paramsync's output matches %s)"
              % os.path.basename(a.expected))
        return
    if a.gloo_error or a.paramsync_error:
        if g_ok or p_ok:
            H.fail("this seed is not a valid torch program: both runs must fail")
        if not re.search(a.gloo_error or ".", g_err):
            H.fail("Gloo failed, but not with /%s/" % a.gloo_error)
        if not re.search(a.paramsync_error or ".", p_err):
            H.fail("paramsync failed, but not with /%s/" % a.paramsync_error)
    elif not g_ok:
        H.fail("the Gloo run failed; there is no baseline")
    if g_ok != p_ok:
        H.fail("Gloo %s but paramsync %s" % ("succeeded" if g_ok else "failed",
                                             "succeeded" if p_ok else "failed"))
    if g_lines != p_lines:
        H.fail("the outputs differ")
    if not g_lines and g_ok:
        H.fail("nothing was printed: the comparison would be vacuous")
    print("PASS (%d lines identical%s)" % (len(g_lines), "" if g_ok else
                                          "; both fail, for the expected reasons"))


if __name__ == "__main__":
    main()
