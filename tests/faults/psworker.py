#!/usr/bin/python3
"""A raw paramsync worker and daemon harness for the fault and security tests.

Speaks paramsync.v1 over grpcio with stubs generated from proto/ at run time
(protoc + grpc_python_plugin, Debian protobuf-compiler-grpc), so it needs no
built client and can send exactly what a test wants: no token, a wrong
token, TLS or not, a tensor sent slowly so that a kill lands mid-transfer.

Used two ways:
  * imported by a test (tests/faults/*.py, tests/security/*.py): Daemon
    starts paramsyncd; Conn/Member/collective() act as a worker in-process;
    WorkerProc runs a worker in a child process (so it can be SIGKILLed).
  * run as `psworker.py run SPEC_JSON` by WorkerProc: joins, runs the spec's
    steps, and prints one JSON line per event (with time.monotonic(), which
    is CLOCK_MONOTONIC and so comparable between processes).

Run with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf).
"""
import array
import atexit
import importlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROTO_DIR = os.path.join(REPO, "proto")

SKIP = 77

_pb = None
_pb_grpc = None
grpc = None


def fail(msg):
    """Ends the test as failed, with the reason."""
    print("FAIL: " + msg, flush=True)
    _keep_or_clean(False)
    sys.exit(1)


def skip(msg):
    print("SKIPPED: " + msg, flush=True)
    sys.exit(SKIP)


def check(cond, msg):
    if not cond:
        fail(msg)


_failures = []
_workdirs = []


def workdir(prefix):
    """A scratch folder for daemon logs and certificates: removed when the test
    passes, kept (and named) when it fails."""
    d = tempfile.mkdtemp(prefix=prefix)
    _workdirs.append(d)
    return d


def _keep_or_clean(passed):
    for d in _workdirs:
        if passed:
            shutil.rmtree(d, True)
        else:
            print("logs kept in " + d, flush=True)


def expect(cond, msg):
    """A failed expectation is reported, and the test goes on to check the rest;
    done() then fails the test. Use check() where going on makes no sense."""
    if not cond:
        print("FAIL: " + msg, flush=True)
        _failures.append(msg)
    return cond


def done():
    """Ends the test: PASS, or FAIL with every failed expectation."""
    if _failures:
        print("FAILED: %d expectation(s) not met:" % len(_failures), flush=True)
        for f in _failures:
            print("  - " + f.splitlines()[0][:400], flush=True)
        _keep_or_clean(False)
        sys.exit(1)
    _keep_or_clean(True)
    print("PASS", flush=True)
    sys.exit(0)


def log(msg):
    print("[%8.3f] %s" % (time.monotonic() % 100000, msg), flush=True)


_stubs_lock = threading.Lock()


def stubs():
    """Generates (once per process tree: PSWORKER_STUBS) and imports the stubs."""
    with _stubs_lock:
        return _stubs()


def _stubs():
    global _pb, _pb_grpc, grpc
    if _pb is not None:
        return _pb, _pb_grpc
    try:
        import grpc as _grpc
    except ImportError:
        skip("python3-grpcio is missing (use Debian's /usr/bin/python3; "
             "scripts/packages.d/faults.txt installs it)")
    grpc = _grpc
    out = os.environ.get("PSWORKER_STUBS")
    if not out or not os.path.exists(os.path.join(out, "paramsync", "v1", "paramsync_pb2.py")):
        out = tempfile.mkdtemp(prefix="psworker-stubs-")
        atexit.register(shutil.rmtree, out, True)
        plugin = "/usr/bin/grpc_python_plugin"
        if not os.path.exists(plugin):
            skip("grpc_python_plugin is missing (Debian protobuf-compiler-grpc)")
        cmd = ["protoc", "--python_out=" + out, "--grpc_out=" + out,
               "--plugin=protoc-gen-grpc=" + plugin, "-I", PROTO_DIR,
               os.path.join(PROTO_DIR, "paramsync", "v1", "paramsync.proto")]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            skip("protoc is missing (Debian protobuf-compiler)")
        if r.returncode != 0:
            fail("protoc failed: " + r.stderr)
        for d in ("paramsync", "paramsync/v1"):
            open(os.path.join(out, d, "__init__.py"), "a").close()
        os.environ["PSWORKER_STUBS"] = out
    sys.path.insert(0, out)
    # A paramsync package elsewhere on sys.path (client/python) must not shadow ours.
    for m in [m for m in sys.modules if m == "paramsync" or m.startswith("paramsync.")]:
        del sys.modules[m]
    _pb = importlib.import_module("paramsync.v1.paramsync_pb2")
    _pb_grpc = importlib.import_module("paramsync.v1.paramsync_pb2_grpc")
    sys.path.remove(out)
    return _pb, _pb_grpc


def code_name(code):
    """'ABORTED' for 10, etc."""
    stubs()
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


def code_of(name):
    stubs()
    return getattr(grpc.StatusCode, name).value[0]


# ---------------------------------------------------------------- daemons

def _die_with_parent():
    """A command prefix that SIGKILLs the child when the test process dies (even by
    SIGKILL, e.g. a ctest timeout), so that no daemon or worker outlives its test:
    util-linux's setpriv sets PR_SET_PDEATHSIG and execs the command. (Not Popen's
    preexec_fn: Python code between fork and exec deadlocks next to gRPC's threads.)
    The signal comes when the thread that started the child ends: start children
    from the main thread."""
    return ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def paramsyncd_path(argv=None):
    """--paramsyncd PATH from argv, else $PARAMSYNCD, else the usual build dir."""
    argv = argv if argv is not None else sys.argv
    if "--paramsyncd" in argv:
        return argv[argv.index("--paramsyncd") + 1]
    if os.environ.get("PARAMSYNCD"):
        return os.environ["PARAMSYNCD"]
    for b in ("build", "build-faults"):
        p = os.path.join(REPO, b, "server", "paramsyncd")
        if os.path.exists(p):
            return p
    fail("no paramsyncd: pass --paramsyncd PATH or set PARAMSYNCD")


class Daemon:
    """One paramsyncd process; its stderr goes to WORKDIR/NAME.log."""

    def __init__(self, binary, workdir, name, args, port=None, metrics=False, env=None):
        self.binary, self.workdir, self.name = binary, workdir, name
        self.args = list(args)
        self.port = port or free_port()
        self.port_chosen = port is None  # free_port's: another test may bind it first
        # The metrics port is the daemon's choice (127.0.0.1:0), read from its log at each
        # start: one picked here could be taken by a parallel test before the daemon binds it.
        self.want_metrics = metrics
        self.metrics_port = None
        self.env = env
        self.proc = None
        self.logpath = os.path.join(workdir, name + ".log")
        self.addr = "127.0.0.1:%d" % self.port

    def start(self, timeout=15, tries=3):
        args = [self.binary] + self.args
        if "--listen" not in self.args:
            args += ["--listen", self.addr]
        args += ["--metrics-addr", "127.0.0.1:0" if self.want_metrics else "off"]
        env = dict(os.environ)
        env.update(self.env or {})
        self.logf = open(self.logpath, "ab")
        self.logf.write(("==== start: %s\n" % " ".join(args)).encode())
        self.logf.flush()
        self.start_offset = self.logf.tell()
        self.proc = subprocess.Popen(_die_with_parent() + args, stdout=self.logf,
                                     stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log_text(since_start=True)
            if "listening on" in text:
                self.port_chosen = False  # known to others from now on
                m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", text)
                self.metrics_port = int(m.group(1)) if m else None
                if self.want_metrics and not m:
                    fail("%s does not say where it serves metrics:\n%s" % (self.name, text))
                return self
            if self.proc.poll() is not None:
                said = self.log_text(since_start=True)
                if (self.port_chosen and tries > 1 and "--listen" not in self.args and
                        "cannot listen on %s" % self.addr in said):
                    # free_port's port was taken between its check and this first bind
                    # (tests run in parallel): start again on another. A restart keeps
                    # its address, which others know.
                    self.port = free_port()
                    self.addr = "127.0.0.1:%d" % self.port
                    return self.start(timeout, tries - 1)
                fail("%s exited with %s at start-up:\n%s" % (self.name, self.proc.returncode,
                                                             said))
            time.sleep(0.05)
        fail("%s did not start within %ss:\n%s" % (self.name, timeout, self.log_text()))

    def log_text(self, since_start=False):
        try:
            with open(self.logpath, "rb") as f:
                if since_start:
                    f.seek(self.start_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def rss_kb(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return -1

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            self.proc.send_signal(sig)
        if self.proc:
            self.proc.wait(timeout=20)

    def stop(self, timeout=15):
        """SIGTERM, and the exit status (the daemon must exit 0); "hung on SIGTERM" (and
        SIGKILL) when it is still there after timeout seconds."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = "hung on SIGTERM"
        if rc != 0:
            # The log is removed when the test passes and out of reach on a CI machine:
            # what the daemon said last (a sanitizer's report, an assertion) is the cause.
            tail = self.log_text(since_start=True).splitlines()[-80:]
            print("---- %s exited %s on SIGTERM; the end of its log:\n%s\n----" %
                  (self.name, rc, "\n".join(tail)), flush=True)
        return rc

    def metrics(self):
        import urllib.request
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics_port,
                                    timeout=5) as r:
            return r.read().decode(errors="replace")


def expect_stopped(*daemons):
    """SIGTERM each daemon in turn; each must exit 0 (a failed expectation otherwise)."""
    for d in daemons:
        rc = d.stop()
        expect(rc == 0, "%s exited %s on SIGTERM" % (d.name, rc))


def expect_alive(*daemons):
    """Each daemon must still run; one that died (a crash: a signal) is a failure,
    reported with its exit status and the end of its log."""
    ok = True
    for d in daemons:
        rc = d.proc.poll() if d.proc else "never started"
        if rc is not None:
            ok = False
            how = ("killed by signal %d" % -rc) if isinstance(rc, int) and rc < 0 else \
                "exit status %s" % rc
            expect(False, "%s died (%s); the end of its log:\n%s" %
                   (d.name, how, d.log_text()[-1500:]))
    return ok


class Cleanup:
    """Stops every daemon and worker process a test started, whatever happens."""

    def __init__(self):
        self.items = []

    def add(self, x):
        self.items.append(x)
        return x

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for x in reversed(self.items):
            try:
                if isinstance(x, Daemon):
                    if x.alive():
                        x.kill(signal.SIGKILL)
                elif isinstance(x, WorkerProc):
                    x.kill()
            except Exception:
                pass
        return False


def cluster(cl, binary, workdir, n_agents, common=(), coord_args=(), agent_args=(), tag="",
            metrics=False):
    """A coordinator and n agents (each registered before this returns); with metrics, they
    serve /metrics (Daemon.metrics)."""
    coord = cl.add(Daemon(binary, workdir, "coordinator" + tag,
                          ["--role", "coordinator"] + list(common) + list(coord_args),
                          metrics=metrics)).start()
    agents = []
    for i in range(n_agents):
        a = cl.add(Daemon(binary, workdir, "agent%d%s" % (i, tag),
                          ["--role", "agent", "--coordinator", coord.addr] + list(common) +
                          list(agent_args), metrics=metrics))
        agents.append(a.start())
    return coord, agents


def wait_registered(conn, addrs, timeout=15):
    """Waits until the coordinator lists every agent address; the last Status."""
    end = time.monotonic() + timeout
    st = None
    while time.monotonic() < end:
        try:
            st = conn.status()
            if all(a in st.agents for a in addrs):
                return st
        except Exception:  # noqa: BLE001 - not serving yet
            pass
        time.sleep(0.1)
    fail("agents %s never registered with the coordinator: %s" % (addrs, st))


def spawn_job(cl, job, world, addr, specs, ready_s=30, **common):
    """Starts one WorkerProc per rank; addr is an address or a function of the rank.
    specs: {rank or "*": spec fields}. Waits for every READY."""
    procs = []
    for r in range(world):
        spec = {"addr": addr(r) if callable(addr) else addr, "job": job, "world": world,
                "rank": r}
        spec.update(common)
        spec.update(specs.get(r, specs.get("*", {})))
        procs.append(cl.add(WorkerProc(spec)))
    for p in procs:
        check(p.wait("ready", ready_s) is not None, "no READY: " + p.describe())
    return procs


def names_rank(msg, r):
    return re.search(r"\brank %d\b" % r, msg) is not None


# ---------------------------------------------------------------- in-process worker

class Conn:
    """A channel to an agent, with the metadata and credentials of one worker."""

    def __init__(self, addr, token=None, tls=None):
        pb, pb_grpc = stubs()
        self.addr = addr
        # gRPC's transparent retry stays on: it only resends calls that never reached the
        # daemon, e.g. the first call on an idle channel whose connection the daemon's
        # keepalive closed (grpcio does not answer pings on a channel with no call).
        opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        if tls:
            def rd(p):
                with open(p, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(
                root_certificates=rd(tls["ca"]) if tls.get("ca") else None,
                private_key=rd(tls["key"]) if tls.get("key") else None,
                certificate_chain=rd(tls["cert"]) if tls.get("cert") else None)
            if tls.get("server_name"):
                opts.append(("grpc.ssl_target_name_override", tls["server_name"]))
            self.channel = grpc.secure_channel(addr, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(addr, options=opts)
        self.md = [("authorization", "Bearer " + token)] if token else []
        self.worker = pb_grpc.WorkerStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def status(self, job="", timeout=5):
        pb, _ = stubs()
        return self.admin.Status(pb.StatusRequest(job=job), timeout=timeout)

    def close(self):
        self.channel.close()


class RpcOutcome:
    def __init__(self, code, message, data=b"", source=-1, t=None):
        self.code, self.message, self.data, self.source = code, message, data, source
        self.t = t if t is not None else time.monotonic()

    @property
    def name(self):
        return code_name(self.code)

    def __repr__(self):
        return "%s %r (%d bytes)" % (self.name, self.message, len(self.data))


def _err(e):
    return RpcOutcome(e.code().value[0], e.details() or "")


class Member:
    """One rank's membership: the open Join stream and its events."""

    def __init__(self, conn):
        self.conn = conn
        self.events = queue.Queue()
        self.all_events = []
        self._close = threading.Event()
        self.ready = None
        self.end = None  # RpcOutcome when the Join stream ended
        self.seq = {}
        self.listener = None  # called with each event, then with the end RpcOutcome

    def join(self, job, world_size, rank=-1, timeout_ms=0, wait_s=20):
        """Returns the READY event, or an RpcOutcome when refused."""
        pb, _ = stubs()
        self.job = job
        req = pb.JoinRequest(job=job, world_size=world_size, rank=rank, timeout_ms=timeout_ms)

        def reqs():
            yield req
            self._close.wait()

        self.call = self.conn.worker.Join(reqs(), metadata=self.conn.md)
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                ev = self.events.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(ev, RpcOutcome):
                return ev
            if ev.kind == pb.JoinEvent.READY:
                self.ready = ev
                self.rank = ev.rank
                self.incarnation = ev.incarnation
                return ev
        return RpcOutcome(code_of("DEADLINE_EXCEEDED"), "psworker: no READY in %ss" % wait_s)

    def _pump(self):
        try:
            for ev in self.call:
                self.all_events.append(ev)
                self.events.put(ev)
                if self.listener:
                    self.listener(ev)
            end = RpcOutcome(0, "")
        except grpc.RpcError as e:
            end = _err(e)
        if self.listener:  # before self.end is set: whoever sees the end has seen this
            self.listener(end)
        self.end = end
        self.events.put(end)

    def wait_event(self, kind, timeout):
        """The next event of kind (a JoinEvent.Kind value), skipping others; None if none."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if isinstance(ev, RpcOutcome):
                self.events.put(ev)
                return None
            if ev.kind == kind:
                return ev

    def leave(self, call_leave=True):
        """Leave (optionally) and half-close the Join stream: a graceful leave."""
        pb, _ = stubs()
        out = None
        if call_leave and self.ready is not None:
            try:
                self.conn.worker.Leave(pb.LeaveRequest(job=self.job, rank=self.rank),
                                       metadata=self.conn.md, timeout=10)
            except grpc.RpcError as e:
                out = _err(e)
        self._close.set()
        if hasattr(self, "_t"):
            self._t.join(timeout=10)
        return out

    def next_seq(self, group=0):
        s = self.seq.get(group, 0)
        self.seq[group] = s + 1
        return s

    def collective(self, kind, count=0, data=b"", **kw):
        kw.setdefault("job", self.job)
        kw.setdefault("rank", self.rank if kw.get("group", 0) == 0 else kw.get("rank"))
        kw.setdefault("incarnation", self.incarnation)
        kw.setdefault("seq", self.next_seq(kw.get("group", 0)))
        return collective(self.conn, kind, count, data, **kw)


def run_ranks(addr, job, world, count=1000, token=None, tls=None, wait_s=15, ranks=None,
              join_timeout_ms=0):
    """Ranks of one job as threads of this process, each with its own channel: join,
    an all_reduce checked against sum_tensor, leave. addr: one address, or a list of
    one per rank. Returns one dict per rank:
    {"rank", "stage": "join" | "collective" | "ok", "code", "message"}."""
    out = [None] * world

    def one(i):
        conn = Conn(addr[i] if isinstance(addr, (list, tuple)) else addr, token=token, tls=tls)
        m = Member(conn)
        try:
            ev = m.join(job, world, ranks[i] if ranks else i, timeout_ms=join_timeout_ms,
                        wait_s=wait_s)
            if isinstance(ev, RpcOutcome):
                out[i] = {"rank": i, "stage": "join", "code": ev.name, "message": ev.message}
                return
            r = m.collective("ALL_REDUCE", count, rank_tensor(m.rank, count))
            if r.code != 0:
                out[i] = {"rank": m.rank, "stage": "collective", "code": r.name,
                          "message": r.message}
            elif r.data != sum_tensor(range(world), count):
                out[i] = {"rank": m.rank, "stage": "collective", "code": "OK",
                          "message": "WRONG RESULT"}
            else:
                out[i] = {"rank": m.rank, "stage": "ok", "code": "OK", "message": ""}
            m.leave()
        finally:
            m._close.set()
            conn.close()

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(wait_s + 30)
    return [o or {"rank": i, "stage": "hung", "code": "?", "message": "no answer"}
            for i, o in enumerate(out)]


def join_all(addr, job, world, token=None, tls=None, wait_s=15):
    """world Members of one job, joined at once (rank i is rank i); fails the test
    unless every one gets READY. addr: one address, or a list of one per rank."""
    members = [Member(Conn(addr[i] if isinstance(addr, (list, tuple)) else addr, token=token,
                           tls=tls)) for i in range(world)]
    evs = [None] * world
    ts = [threading.Thread(target=lambda i=i: evs.__setitem__(
        i, members[i].join(job, world, i, wait_s=wait_s)), daemon=True) for i in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(wait_s + 5)
    for i, ev in enumerate(evs):
        check(ev is not None and not isinstance(ev, RpcOutcome),
              "job %s rank %d did not join: %s" % (job, i, ev))
    return members


def in_threads(fns, timeout=60):
    """Runs the functions at once; their results in order (an exception raised is the
    result; None if one did not end within timeout)."""
    out = [None] * len(fns)

    def one(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            out[i] = e

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return out


def all_ok(results):
    return all(r["stage"] == "ok" for r in results)


def collective(conn, kind, count=0, data=b"", job="", group=0, seq=0, op="SUM",
               dtype="FLOAT32", root=0, peer=0, rank=0, tag=0, timeout_ms=0, chunk=1 << 20,
               incarnation=0, slow_s=0.0, on_sent=None, rpc_timeout=None, shm="",
               shm_in_offset=0, shm_out_offset=0, shm_process=False, own_block=False,
               shm_in_blocks=(), shm_out_blocks=(), shm_out=""):
    """One rank's Collective call; returns an RpcOutcome with the received bytes.

    chunk: payload bytes per frame; slow_s: pause after each frame; on_sent(n):
    called after each frame with the bytes sent so far; shm, shm_in_offset,
    shm_out_offset, shm_process, own_block, shm_in_blocks, shm_out_blocks, shm_out: the
    header's shared-memory fields (then data is empty)."""
    pb, _ = stubs()
    hdr = pb.CollectiveHeader(
        job=job, group=group, seq=seq, kind=getattr(pb, kind) if isinstance(kind, str) else kind,
        op=getattr(pb, op) if isinstance(op, str) else op,
        dtype=getattr(pb, dtype) if isinstance(dtype, str) else dtype,
        count=count, root=root, peer=peer, rank=rank, tag=tag, timeout_ms=timeout_ms,
        chunk_bytes=chunk, incarnation=incarnation, shm=shm, shm_in_offset=shm_in_offset,
        shm_out_offset=shm_out_offset, shm_process=shm_process, own_block=own_block,
        shm_in_blocks=shm_in_blocks, shm_out_blocks=shm_out_blocks, shm_out=shm_out)
    mv = memoryview(data)

    def reqs():
        off = 0
        first = True
        while first or off < len(mv):
            piece = bytes(mv[off:off + chunk])
            f = pb.Frame(offset=off, data=piece)
            if first:
                f.header.CopyFrom(hdr)
            first = False
            yield f
            off += len(piece)
            if on_sent:
                on_sent(off)
            if slow_s:
                time.sleep(slow_s)

    out = []
    result = None
    try:
        call = conn.worker.Collective(reqs(), metadata=conn.md, timeout=rpc_timeout)
        for f in call:
            if f.HasField("result"):
                result = f.result
            if f.data:
                out.append(f.data)
        data = b"".join(out)
        return RpcOutcome(0, result.message if result else "", data,
                          result.source if result else -1)
    except grpc.RpcError as e:
        return _err(e)


def floats(values):
    return array.array("f", values).tobytes()


def unfloats(b):
    a = array.array("f")
    a.frombytes(b)
    return a


def rank_tensor(rank, count):
    """The test tensor of a rank: element i is (rank + 1) * 1000 + i % 97."""
    return floats([(rank + 1) * 1000 + (i % 97) for i in range(count)])


def sum_tensor(ranks, count):
    """The element-wise sum of rank_tensor over ranks (exact in float32 for small sizes)."""
    s = sum(r + 1 for r in ranks) * 1000
    n = len(ranks)
    return floats([s + n * (i % 97) for i in range(count)])


# ---------------------------------------------------------------- worker processes

class WorkerProc:
    """A worker in a child process, driven by a spec; its JSON events are collected.

    spec: {addr, job, world, rank, token?, tls?, steps: [...]} where a step is
      {"do": "collective", "kind": "ALL_REDUCE", "count": N, "verify": bool, "raw": bool,
       "chunk": B, "slow_s": S, "announce_after": B, "timeout_ms": T, "no_data": bool}
          (raw: zeros, N float32 elements; an ALL_TO_ALL's N per rank; no_data: none sent)
          -> {"ev": "coll_start"}, {"ev": "sending"} once announce_after bytes are out,
             {"ev": "coll", "code", "message", "t", "bytes", "verified"}
      {"do": "sleep", "s": S}
      {"do": "wait_lost", "s": S}       wait for a MEMBER_LOST, at most S
      {"do": "wait_join_end", "s": S}   wait for the Join stream to end, at most S
      {"do": "leave"}                   -> {"ev": "left", "code", "message"}
    Join events are printed as they come, whatever step runs: {"ev": "lost", "rank"},
    {"ev": "aborted"}, {"ev": "join_end", "code", "message"}.
    Every process prints {"ev": "ready", ...} after READY and {"ev": "end"} last."""

    def __init__(self, spec, name=None, prefix=()):
        """prefix: a command the worker runs under, e.g. ["ip", "netns", "exec", NS]."""
        self.spec = spec
        self.name = name or "%s/r%s" % (spec.get("job"), spec.get("rank"))
        self.lines = []
        self.cond = threading.Condition()
        stubs()  # make the stubs once, in PSWORKER_STUBS, for the child to reuse
        self.proc = subprocess.Popen(_die_with_parent() + list(prefix) +
                                     [sys.executable, os.path.abspath(__file__), "run",
                                      json.dumps(spec)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"ev": "text", "text": line.rstrip()}
            with self.cond:
                self.lines.append(ev)
                self.cond.notify_all()
        with self.cond:
            self.lines.append({"ev": "eof", "t": time.monotonic()})
            self.cond.notify_all()

    def _read_err(self):
        for line in self.proc.stderr:
            self.err.append(line)

    def wait(self, ev, timeout, pred=None, **match):
        """The first event named ev (whose fields match, and pred(event) if given), or None
        after timeout."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for x in self.lines:
                    if x.get("ev") == ev and all(x.get(k) == v for k, v in match.items()) and \
                            (pred is None or pred(x)):
                        return x
                if any(x.get("ev") == "eof" for x in self.lines) and ev != "eof":
                    return None
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def events(self, ev):
        with self.cond:
            return [x for x in self.lines if x.get("ev") == ev]

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def finish(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def describe(self):
        with self.cond:
            return "%s: %s%s" % (self.name, json.dumps(self.lines),
                                 ("\nstderr: " + "".join(self.err[-20:])) if self.err else "")


_emit_lock = threading.Lock()


def _emit(**kw):
    kw.setdefault("t", time.monotonic())
    with _emit_lock:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()


def _run_spec(spec):
    pb, _ = stubs()
    conn = Conn(spec["addr"], token=spec.get("token"), tls=spec.get("tls"))
    m = Member(conn)
    ready = m.join(spec["job"], spec["world"], spec.get("rank", -1),
                   timeout_ms=spec.get("join_timeout_ms", 0), wait_s=spec.get("join_wait_s", 30))
    if isinstance(ready, RpcOutcome):
        _emit(ev="join_failed", code=ready.name, message=ready.message)
        _emit(ev="end")
        return
    _emit(ev="ready", rank=ready.rank, world=ready.world_size, incarnation=ready.incarnation,
          hub=ready.hub)

    def listener(ev):
        if isinstance(ev, RpcOutcome):
            _emit(ev="join_end", code=ev.name, message=ev.message, t=ev.t)
        elif ev.kind == pb.JoinEvent.MEMBER_LOST:
            _emit(ev="lost", rank=ev.rank, message=ev.message)
        elif ev.kind == pb.JoinEvent.JOB_ABORTED:
            _emit(ev="aborted", message=ev.message)

    m.listener = listener
    for ev in m.all_events[1:]:  # anything that came before the listener was set
        listener(ev)
    if m.end is not None:
        listener(m.end)
    for st in spec.get("steps", []):
        do = st["do"]
        if do == "sleep":
            time.sleep(st["s"])
        elif do == "wait_lost":  # until a MEMBER_LOST (printed as it comes), at most s
            m.wait_event(pb.JoinEvent.MEMBER_LOST, st["s"])
        elif do == "wait_join_end":  # until the Join stream ends, at most s
            end = time.monotonic() + st["s"]
            while m.end is None and time.monotonic() < end:
                time.sleep(0.01)
        elif do == "leave":
            r = m.leave()
            _emit(ev="left", code=r.name if r else "OK", message=r.message if r else "")
        elif do == "rejoin":  # leave (if still a member) and join again: an elastic restart
            if m.end is None:
                m.leave()
            m.listener = None
            m = Member(conn)
            ready = m.join(spec["job"], st["world"], st.get("rank", -1),
                           wait_s=st.get("wait_s", 30))
            if isinstance(ready, RpcOutcome):
                _emit(ev="join_failed", code=ready.name, message=ready.message)
                break
            _emit(ev="ready", rank=ready.rank, world=ready.world_size,
                  incarnation=ready.incarnation, hub=ready.hub)
            m.listener = listener
        elif do == "collective":
            count = st.get("count", 0)
            kind = st.get("kind", "ALL_REDUCE")
            if st.get("no_data"):  # a recv's: its count is what comes back
                data = b""
            elif st.get("raw"):
                # An all_to_all's input is a block of count for every rank.
                blocks = m.ready.world_size if kind == "ALL_TO_ALL" else 1
                data = bytes(count * 4 * blocks)
            else:
                data = rank_tensor(m.rank, count) if count else b""
            state = {"said": False}

            def on_sent(n, st=st, state=state):
                if not state["said"] and n >= st.get("announce_after", 1):
                    state["said"] = True
                    _emit(ev="sending", bytes=n)

            _emit(ev="coll_start", count=count)
            r = m.collective(kind, count, data, chunk=st.get("chunk", 1 << 20),
                             slow_s=st.get("slow_s", 0.0), on_sent=on_sent,
                             timeout_ms=st.get("timeout_ms", 0))
            verified = None
            if r.code == 0 and st.get("verify"):
                verified = r.data == sum_tensor(range(m.ready.world_size), count)
            _emit(ev="coll", code=r.name, message=r.message, t=r.t, bytes=len(r.data),
                  verified=verified)
        else:
            raise ValueError("unknown step " + do)
    if spec.get("hold_s"):
        time.sleep(spec["hold_s"])
    m.listener = None
    _emit(ev="end")
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        _run_spec(json.loads(sys.argv[2]))
    else:
        print(__doc__)
        sys.exit(2)
