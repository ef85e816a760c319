"""Launches N workers of one job, like torchrun: python3 -m paramsync.run --nproc N script.py [args]

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, PARAMSYNC_ADDR and PARAMSYNC_JOB in its environment, so that
init_process_group("paramsync") (env://) needs no arguments. Without
--daemon (or $PARAMSYNC_ADDR), a paramsyncd is started on a free loopback
port for the run and stopped after it; it is found as $PARAMSYNC_DAEMON,
else `paramsyncd` on PATH. The exit status is 0 when every worker exits 0;
otherwise the remaining workers are stopped and the status is the first
failing worker's (128+N for a signal). Output is passed through untouched
unless --prefix asks for "[RANK]: " before each line.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid


def _parser():
    p = argparse.ArgumentParser(
        prog="python3 -m paramsync.run",
        description="Start N workers of one paramsync job (and a paramsyncd if none is given).")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   default=1, help="number of workers (default 1)")
    p.add_argument("--daemon", metavar="HOST:PORT", default=os.environ.get("PARAMSYNC_ADDR"),
                   help="use the paramsyncd at this address (default: $PARAMSYNC_ADDR; "
                        "if unset, start one)")
    p.add_argument("--daemon-bin", metavar="PATH", default=os.environ.get("PARAMSYNC_DAEMON"),
                   help="the paramsyncd to start (default: $PARAMSYNC_DAEMON, else PATH)")
    p.add_argument("--daemon-arg", metavar="ARG", action="append", default=[],
                   help="extra argument for the started paramsyncd (repeatable)")
    p.add_argument("--job", default=os.environ.get("PARAMSYNC_JOB"),
                   help="job id (default: $PARAMSYNC_JOB, else a fresh one per launch)")
    p.add_argument("--prefix", action="store_true",
                   help="prefix each output line with '[RANK]: '")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the script argument as a module (python -m)")
    p.add_argument("--no-python", action="store_true",
                   help="run the script argument as a program, not with this Python")
    p.add_argument("script", help="the worker script (or module, or program)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _find_daemon(explicit):
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            sys.exit("paramsync.run: %s is not an executable paramsyncd" % explicit)
        return explicit
    found = shutil.which("paramsyncd")
    if not found:
        sys.exit("paramsync.run: no paramsyncd: put it on PATH, set $PARAMSYNC_DAEMON, or "
                 "give --daemon HOST:PORT of a running one")
    return found


def _start_daemon(binary, extra, tmpdir):
    announce = os.path.join(tmpdir, "paramsyncd.addr")
    log_path = os.path.join(tmpdir, "paramsyncd.log")
    log = open(log_path, "wb")
    # No metrics endpoint for a daemon that lives as long as one run (--daemon-arg
    # --metrics-addr=HOST:PORT turns it back on).
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--announce-file", announce,
                             "--metrics-addr", "off"] + extra,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.stderr.write(open(log_path, errors="replace").read())
            sys.exit("paramsync.run: %s exited with status %d before serving"
                     % (binary, proc.returncode))
        try:
            with open(announce) as f:
                text = f.read()
            if text.endswith("\n") and text.strip():
                return proc, text.strip(), log_path
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    sys.exit("paramsync.run: %s did not start serving within 30 s" % binary)


def _stop(proc, grace=5.0):
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pump(stream, out, prefix):
    for line in iter(stream.readline, b""):
        out.write(prefix + line)
        out.flush()
    stream.close()


def _split(addr):
    if addr.startswith("unix:"):
        return addr, ""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), port


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.nproc < 1:
        sys.exit("paramsync.run: --nproc must be at least 1")
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    tmpdir = tempfile.mkdtemp(prefix="paramsync-run-")
    daemon = None
    log_path = None
    workers = []
    status = 0
    try:
        addr = a.daemon
        if not addr:
            daemon, addr, log_path = _start_daemon(_find_daemon(a.daemon_bin), a.daemon_arg,
                                                   tmpdir)
        host, port = _split(addr)
        job = a.job or "run-%s" % uuid.uuid4().hex[:12]
        py = [sys.executable] + (["-u"] if a.prefix else [])
        if a.no_python:
            cmd = [a.script] + args
        elif a.module:
            cmd = py + ["-m", a.script] + args
        else:
            cmd = py + [a.script] + args
        pumps = []
        for rank in range(a.nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(a.nproc), LOCAL_WORLD_SIZE=str(a.nproc),
                       GROUP_RANK="0", MASTER_ADDR=host, MASTER_PORT=port,
                       PARAMSYNC_ADDR=addr, PARAMSYNC_JOB=job)
            if a.prefix:
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
                pre = ("[%d]: " % rank).encode()
                for s, o in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(s, o, pre), daemon=True)
                    t.start()
                    pumps.append(t)
            else:
                p = subprocess.Popen(cmd, env=env)
            workers.append(p)

        def forward(signum, frame):
            for w in workers:
                if w.poll() is None:
                    w.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        pending = list(workers)
        while pending:
            for w in list(pending):
                rc = w.poll()
                if rc is None:
                    continue
                pending.remove(w)
                if rc != 0 and status == 0:
                    status = rc if rc > 0 else 128 - rc
                    rank = workers.index(w)
                    sys.stderr.write("paramsync.run: worker %d exited with %s; stopping the "
                                     "others\n" % (rank, "status %d" % rc if rc > 0
                                                   else "signal %d" % -rc))
                    for o in pending:
                        o.terminate()
                    deadline = time.monotonic() + 10
                    for o in pending:
                        try:
                            o.wait(max(0.1, deadline - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            o.kill()
            time.sleep(0.01)
        for t in pumps:
            t.join(5)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if daemon is not None:
            _stop(daemon)
            if status != 0 and log_path:
                lines = open(log_path, errors="replace").read().splitlines()[-30:]
                sys.stderr.write("paramsync.run: the daemon's log ends with:\n")
                sys.stderr.write("".join("  %s\n" % line for line in lines))
        shutil.rmtree(tmpdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
