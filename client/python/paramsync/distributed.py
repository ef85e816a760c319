"""torch.distributed's API on a paramsync daemon.

    import paramsync.distributed as dist

    dist.init_process_group("paramsync")        # env://, tcp://HOST:PORT or file:///PATH
    t = numpy.arange(4, dtype=numpy.float32)      # or a torch CPU tensor
    dist.all_reduce(t, op=dist.ReduceOp.SUM)      # in place, like torch

Every collective is one gRPC call (paramsync.v1.Worker/Collective) to the
daemon, which matches the ranks' calls, checks that they agree and computes
the result; this module only moves bytes (through a shared-memory segment
instead of frames when the daemon is on this host and a payload is 64 KiB or
more, and collectives of up to 2 KiB through a futex "doorbell" without a
call, as the C client does: see _shm.py; tensors from empty() are read and
written by the daemon in place, with no copy here). Names, signatures and
rank rules are torch.distributed's: `src`/`dst` are global ranks even with
`group=`, collectives on a group the caller is not in warn and do nothing,
and `async_op=True` returns a Work with wait() and is_completed().

Errors the daemon reports become ParamsyncError (a RuntimeError, as torch
raises) carrying the gRPC status `code` and the daemon's `details`; local
argument errors are TypeError (unsupported tensor types and dtypes) or
ValueError (sizes, ranks), raised before anything is sent.

The job id that keeps jobs apart on a shared daemon is, in order: `?job=` in
init_method, `group_name` when given, $PARAMSYNC_JOB, the file path for
file://, else "default" (the C client's rule, so that workers in different
languages meet without configuration). `python3 -m paramsync.run` sets a
fresh $PARAMSYNC_JOB for each launch.
"""
import atexit
import collections
import concurrent.futures
import enum
import os
import pickle
import queue
import sys
import threading
import time
import warnings
from datetime import timedelta
from urllib.parse import parse_qs, unquote, urlparse

import grpc
import numpy as np

from . import _barrier, _peer, _shm
from . import _tensor as T
from ._proto import pb, pb_grpc

__all__ = [
    "Backend", "GroupMember", "P2POp", "ParamsyncError", "ProcessGroup", "ReduceOp", "Work",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "destroy_process_group", "empty", "free", "gather", "gather_object", "get_backend",
    "get_global_rank", "get_group_rank", "get_process_group_ranks", "get_rank", "get_world_size",
    "group", "init_process_group", "irecv", "is_available", "is_gloo_available", "is_initialized",
    "is_mpi_available", "is_nccl_available", "is_shared", "is_torchelastic_launched",
    "is_ucc_available", "isend", "monitored_barrier", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "recv", "reduce", "reduce_op", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
]

default_pg_timeout = timedelta(minutes=30)

_MAX_CHUNK = 4 << 20


def _chunk_bytes():
    v = os.environ.get("PARAMSYNC_CHUNK_BYTES")
    n = int(v) if v else 1 << 20
    return max(1, min(n, _MAX_CHUNK))


class ReduceOp(enum.IntEnum):
    """Reduce operations; the values are paramsync.v1.ReduceOp's."""
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7


reduce_op = ReduceOp  # torch's deprecated alias

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class Backend:
    PARAMSYNC = "paramsync"


_CODES = {s.value[0]: s for s in grpc.StatusCode}


class ParamsyncError(RuntimeError):
    """An error reported by the daemon (or the connection to it).

    code: the grpc.StatusCode; details: the daemon's message (it names the
    ranks and the field when ranks disagree)."""

    def __init__(self, message, code=grpc.StatusCode.UNKNOWN, details=""):
        super().__init__(message)
        self.code = code
        self.details = details or message

    @property
    def code_value(self):
        """The numeric gRPC status code (the magnitude of the C client's PS_E* codes)."""
        return self.code.value[0]


def _error(what, code, details):
    """A ParamsyncError: "<what>: <CODE>: <details>", without repeating what the
    daemon's message already says ("all_reduce (group 0, seq 3): ...")."""
    if details.startswith(what):
        return ParamsyncError("%s: %s" % (code.name, details), code, details)
    return ParamsyncError("%s: %s: %s" % (what, code.name, details), code, details)


def _rpc_error(e, what):
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return _error(what, code, details)


class _WorldToken:
    def __repr__(self):
        return "<paramsync group.WORLD>"


class _NonMember:
    def __repr__(self):
        return "<paramsync GroupMember.NON_GROUP_MEMBER>"


class GroupMember:
    WORLD = _WorldToken()
    NON_GROUP_MEMBER = _NonMember()


class group:  # noqa: N801 - torch's name
    WORLD = GroupMember.WORLD


class ProcessGroup:
    """A group of the job: `ranks` are job ranks in group-rank order."""

    def __init__(self, world, gid, ranks, group_rank):
        self._world = world
        self.id = gid
        self.ranks = list(ranks)
        self._rank = group_rank
        self._seq = 0
        self._send_seq = {}
        self._recv_seq = 0
        self._bar = _barrier.Group()  # its direct barriers (_barrier)
        world.bar_groups.append(self._bar)

    def rank(self):
        return self._rank

    def size(self):
        return len(self.ranks)

    def name(self):
        return "paramsync"

    def __repr__(self):
        return "<paramsync ProcessGroup %d ranks=%s rank=%d>" % (self.id, self.ranks, self._rank)


class _Threads:
    """Threads for async operations. Each operation gets one at once: operations may
    wait on each other across ranks (an irecv for a peer's send that another thread here
    has yet to make), so none may wait for a free thread. A thread that finished its
    operation waits IDLE_S for the next before it ends, since starting one costs about
    as much as a small collective through the doorbell."""

    IDLE_S = 2.0

    def __init__(self):
        self._reset()

    def _reset(self):
        self._cond = threading.Condition(threading.Lock())
        self._queue = collections.deque()
        self._idle = 0

    def run(self, job):
        with self._cond:
            if self._idle > len(self._queue):
                self._queue.append(job)
                self._cond.notify()
                return
        threading.Thread(target=self._main, args=(job,), daemon=True,
                         name="paramsync-work").start()

    def _main(self, job):
        while job is not None:
            job()
            with self._cond:
                self._idle += 1
                end = time.monotonic() + self.IDLE_S
                while not self._queue and time.monotonic() < end:
                    self._cond.wait(end - time.monotonic())
                job = self._queue.popleft() if self._queue else None
                self._idle -= 1


_THREADS = _Threads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_THREADS._reset)  # a child has none of our threads


class Work:
    """What async_op=True returns: wait() blocks and raises the operation's error, if any."""

    def __init__(self, fn, outputs=None):
        self._done = threading.Event()
        self._exc = None
        self._source = -1
        self._outputs = outputs or []
        self._future = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()
        _THREADS.run(lambda: self._run(fn))

    def _run(self, fn):
        try:
            r = fn()
            if isinstance(r, int):
                self._source = r
            self._future.set_result(self._outputs)
        except BaseException as e:  # noqa: B902 - handed to wait()
            self._exc = e
            self._future.set_exception(e)
        finally:
            self._done.set()

    def wait(self, timeout=None):
        """Waits for completion (timeout: seconds or timedelta); raises its error. Returns True."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if not self._done.wait(timeout):
            raise ParamsyncError("Work.wait: timed out after %ss" % timeout,
                                 grpc.StatusCode.DEADLINE_EXCEEDED)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._exc is None

    def exception(self):
        return self._exc

    def source_rank(self):
        """For a completed irecv: the sender's global rank; otherwise -1."""
        return self._source

    _source_rank = source_rank

    def result(self):
        return self._outputs

    def get_future(self):
        """A concurrent.futures.Future that completes with result()."""
        return self._future

    def synchronize(self):
        pass


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError("cannot read %s %s: %s" % (what, path, e.strerror)) from None


def _channel(addr):
    """A channel to the daemon: plaintext, or TLS when $PARAMSYNC_TLS_CA is set (with
    $PARAMSYNC_TLS_CERT/$PARAMSYNC_TLS_KEY for mutual TLS and $PARAMSYNC_TLS_SERVER_NAME
    for a certificate name other than the host), as the C client reads them."""
    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ca = os.environ.get("PARAMSYNC_TLS_CA")
    if not ca:
        return grpc.insecure_channel(addr, options=opts)
    cert, key = os.environ.get("PARAMSYNC_TLS_CERT"), os.environ.get("PARAMSYNC_TLS_KEY")
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "PARAMSYNC_TLS_CA"),
        private_key=_read(key, "PARAMSYNC_TLS_KEY") if key else None,
        certificate_chain=_read(cert, "PARAMSYNC_TLS_CERT") if cert else None)
    name = os.environ.get("PARAMSYNC_TLS_SERVER_NAME")
    if name:
        opts.append(("grpc.ssl_target_name_override", name))
    return grpc.secure_channel(addr, creds, options=opts)


class _World:
    """The default process group: the channel, the membership stream and the groups."""

    def __init__(self, addr, job, timeout_ms, scratch_max):
        self.addr = addr
        self.job = job
        self.timeout_ms = timeout_ms
        self.channel = _channel(addr)
        token = os.environ.get("PARAMSYNC_TOKEN")
        self.md = (("authorization", "Bearer " + token),) if token else None
        self.stub = pb_grpc.WorkerStub(self.channel)
        # The same method for a collective whose request is one frame: gRPC sends that
        # frame and the half-close in one batch, where a request iterator's thread sends
        # the half-close later; an agent forwarding the call to another's hub then passes
        # both on at once instead of starting a thread to wait for it (server/agent.c,
        # collective_proxy).
        self.collective_one = self.channel.unary_stream(
            "/paramsync.v1.Worker/Collective", request_serializer=pb.Frame.SerializeToString,
            response_deserializer=pb.Frame.FromString)
        self.lock = threading.Lock()
        self.failure = None
        self.inflight = set()
        self.leaving = False
        self.stop = threading.Event()
        self.join_call = None
        self.pump = None
        self.rank = -1
        self.size = 0
        self.incarnation = 0
        self.world_group = None
        self.peer_sets = None
        self.scratch_free = []  # plain arrays
        self.scratch_mem = []  # arrays on memory of empty()
        self.scratch_max = scratch_max  # the largest kept ($PARAMSYNC_SCRATCH_BYTES)
        self.barrier_sets = None  # direct barriers (_barrier): the coordinator's sets
        self.bar_groups = []  # every group's _barrier.Group, closed at leave
        self.peer_self = _peer.Self()
        self.peer_used = 0  # collectives that went by peer copies
        self.peer_maps = _peer.Maps()  # the other ranks' empty() segments mapped here
        self.n_new_groups = 0
        self.crashed = False
        # One shared-memory segment for all of this rank's groups (the agent keeps
        # one per (job, rank), and a new one replaces the old), and spares for
        # collectives in flight beside the one using it.
        self.shm = _shm.Payloads(
            lambda name, size, magic, slot: self._shm_attach(name, size, magic, slot=slot))
        # Collectives without a call, when the agent is on this host.
        self.doorbell = _shm.Doorbells(
            lambda name, size, magic: self._shm_attach(name, size, magic, doorbell=True))
        # Large collectives read and written by the agent in this process's own buffers.
        self.process = _shm.Process(
            lambda name, size, magic, address: self._shm_attach(name, size, magic,
                                                                process=True, address=address))
        # Memory from empty(): segments of their own, used in place.
        self.mem = _shm.Registered(
            lambda name, size, magic: self._shm_attach(name, size, magic, registered=True),
            self._shm_detach)

    # -- membership --------------------------------------------------------

    def join(self, world_size, rank, join_timeout_ms):
        peer_copies = _peer.wanted(self.peer_self)
        req = pb.JoinRequest(job=self.job, world_size=world_size, rank=rank,
                             timeout_ms=min(join_timeout_ms, 0xFFFFFFFF),
                             peer_copies=peer_copies,
                             pid_namespace=self.peer_self.pidns_ino if peer_copies else 0,
                             direct_barrier=peer_copies and _barrier.wanted())
        stop = self.stop

        def requests():
            yield req
            stop.wait()  # the sending side stays open for the whole membership

        self.join_call = self.stub.Join(requests(), wait_for_ready=True, metadata=self.md)
        first = queue.Queue()
        self.pump = threading.Thread(target=self._pump, args=(first,), daemon=True,
                                     name="paramsync-join")
        self.pump.start()
        try:
            ev = first.get(timeout=join_timeout_ms / 1000.0 + 10)
        except queue.Empty:
            self.join_call.cancel()
            raise ParamsyncError(
                "init_process_group: no answer from the daemon at %s within %d ms (job %r)"
                % (self.addr, join_timeout_ms, self.job),
                grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if isinstance(ev, Exception):
            stop.set()
            raise ev
        if ev.kind != pb.JoinEvent.READY:
            stop.set()
            self.join_call.cancel()
            raise ParamsyncError("init_process_group: job %r: %s %s" % (
                self.job, pb.JoinEvent.Kind.Name(ev.kind), ev.message), grpc.StatusCode.ABORTED,
                ev.message)
        if ev.world_size != world_size:
            stop.set()
            self.join_call.cancel()
            raise ParamsyncError("init_process_group: the daemon says world size %d, not %d"
                                 % (ev.world_size, world_size), grpc.StatusCode.INTERNAL)
        self.rank = ev.rank
        self.size = ev.world_size
        self.incarnation = ev.incarnation
        # Peer copies (_peer): the coordinator's sets, one per job rank.
        self.peer_sets = list(ev.peer_sets) if len(ev.peer_sets) == ev.world_size else None
        self.barrier_sets = (list(ev.barrier_sets) if len(ev.barrier_sets) == ev.world_size
                             else None)
        self.world_group = ProcessGroup(self, 0, range(self.size), self.rank)

    def _pump(self, first):
        ready = False
        err = None
        try:
            for ev in self.join_call:
                if not ready:
                    ready = True
                    first.put(ev)
                    continue
                if ev.kind == pb.JoinEvent.MEMBER_LOST:
                    # The coordinator's message names the job, the rank and why.
                    self.fail(ParamsyncError(
                        ev.message or "rank %d of job %r was lost (it died or its connection "
                        "broke)" % (ev.rank, self.job), grpc.StatusCode.ABORTED))
                elif ev.kind == pb.JoinEvent.JOB_ABORTED:
                    self.fail(ParamsyncError("job %r was aborted: %s" % (self.job, ev.message),
                                             grpc.StatusCode.ABORTED, ev.message))
        except grpc.RpcError as e:
            err = _rpc_error(e, "init_process_group (job %r at %s)" % (self.job, self.addr))
        if not ready:
            first.put(err or ParamsyncError("init_process_group: the daemon closed the "
                                            "membership stream", grpc.StatusCode.UNAVAILABLE))
        elif not self.leaving:
            self.fail(err or ParamsyncError("the daemon ended the membership of job %r"
                                            % self.job, grpc.StatusCode.UNAVAILABLE))

    def fail(self, err):
        with self.lock:
            if self.failure is None:
                self.failure = err
            calls = list(self.inflight)
        for c in calls:
            c.cancel()

    # Scratch buffers for the collectives composed here (an uneven all_to_all's padded
    # blocks): the largest SCRATCH_KEEP of at most scratch_max bytes of each kind
    # ($PARAMSYNC_SCRATCH_BYTES) are kept for the next call, whose pages are then mapped
    # (and collapsed into huge pages) already. With registered, memory of empty(), which
    # the agent takes in place beside the call's other buffer (header.shm_out): for calls
    # through the agent.
    SCRATCH_KEEP = 2

    def scratch(self, nbytes, registered=False):
        """A uint8 buffer of at least nbytes (give it back with scratch_give)."""
        pool = self.scratch_mem if registered else self.scratch_free
        with self.lock:
            for k, b in enumerate(pool):
                if b.size >= nbytes:
                    return pool.pop(k)
        if registered:
            return np.frombuffer(self.mem.alloc(max(nbytes, 1)).map, np.uint8)
        return np.empty(max(nbytes, 1), np.uint8)

    def scratch_give(self, *bufs, registered=False, keep=True):
        """Gives buffers of scratch back; keep=False (the call failed, and may have been
        given up on while an agent still wrote into them): not for the next call."""
        pool = self.scratch_mem if registered else self.scratch_free
        with self.lock:
            pool.extend(b for b in bufs if b is not None and keep)
            pool.sort(key=lambda b: -b.size)
            kept = [b for b in pool if b.size <= self.scratch_max][:self.SCRATCH_KEEP]
            drop = [b for b in pool if not any(b is k for k in kept)]
            drop += [b for b in bufs if b is not None and not keep]
            pool[:] = kept
        for b in drop if registered else ():
            self.mem.free(b.ctypes.data)

    def leave(self, graceful=True):
        if self.leaving:
            return
        self.leaving = True
        try:
            if graceful:  # also after a failure: this process is alive, and says so
                try:
                    self.stub.Leave(pb.LeaveRequest(job=self.job, rank=self.rank), timeout=10,
                                   metadata=self.md)
                except grpc.RpcError:
                    pass
                self.stop.set()  # half-close: a graceful leave
                self.pump.join(10)
            else:
                self.join_call.cancel()  # a broken stream: the others hear MEMBER_LOST
                self.stop.set()
        finally:
            if self.shm is not None:
                self.shm.close()
            self.mem.close()
            self.peer_maps.close()
            for b in self.bar_groups:
                b.close()
            self.doorbell.close()
            self.process.close()
            self.channel.close()

    # -- collectives -------------------------------------------------------

    def _shm_attach(self, name, size, magic, registered=False, doorbell=False, slot=0,
                    process=False, address=0):
        """Offers a segment to the agent (Worker.ShmAttach). Raises _shm.AttachRefused when
        it will never map ours (it said so, or it lacks or cannot serve the method; a
        process segment also when the agent may not reach this process's memory)."""
        req = pb.ShmAttachRequest(job=self.job, rank=self.rank, name=name, size=size,
                                  magic=magic, registered=registered, doorbell=doorbell,
                                  slot=slot, process=process,
                                  pid=os.getpid() if process else 0, address=address)
        try:
            resp = self.stub.ShmAttach(req, timeout=10, metadata=self.md)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                raise _shm.AttachRefused("ShmAttach: %s: %s" % (e.code().name, e.details())) \
                    from None
            raise
        if not resp.attached:
            raise _shm.AttachRefused(resp.reason or "the agent did not attach the segment")
        if process and not resp.process_memory:  # an agent before process segments
            raise _shm.AttachRefused("the agent does not read and write workers' memory")
        return resp

    def _shm_detach(self, name):
        self.stub.ShmDetach(pb.ShmDetachRequest(job=self.job, rank=self.rank, name=name),
                            timeout=10, metadata=self.md)

    def _shm_begin(self, header, send, recv, rung=False):
        """Takes this collective through shared memory when it can: in place in memory
        from empty(), else through the process group's segment (the input copied in).
        Returns a _ShmUse, or None (gRPC frames). rung: for the doorbell, any size."""
        # all_reduce and reduce: the agent writes the output over the input.
        in_place = header.kind in (_K.ALL_REDUCE, _K.REDUCE)
        # torch's in-place all_gather (gather, scatter): the input is the rank's own block
        # of the output, which agents that say so leave as it is (header.own_block).
        own = header.kind in (_K.ALL_GATHER, _K.GATHER, _K.SCATTER) and _shm.own_in_place(
            header.kind == _K.SCATTER, header.rank, send, recv)
        got = self.mem.begin(in_place, send, recv, own)
        if got is not None:
            mems, in_off, out_off = got
            header.shm = mems[0].name
            header.shm_out = mems[1].name if len(mems) > 1 else ""
            header.shm_in_offset = in_off
            header.shm_out_offset = out_off
            header.own_block = own
            return _ShmUse(self.mem.end, mems, None)
        got = self.process.begin(in_place, send, recv, own) if rung else None
        if got is not None:
            header.shm = self.process.name
            header.shm_process = True
            for at, offset, blocks in zip(got, ("shm_in_offset", "shm_out_offset"),
                                          (header.shm_in_blocks, header.shm_out_blocks)):
                if isinstance(at, list):  # a list form: one address per buffer
                    blocks.extend(at)
                else:
                    setattr(header, offset, at)
            header.own_block = own
            return _ShmUse(lambda _, discard=False: None, None, None, direct=True)
        if self.shm is None:
            return None
        got = self.shm.begin(in_place, send.total if send is not None else 0,
                             recv.total if recv is not None else 0, rung)
        if got is None:
            return None
        seg, off = got
        try:
            if send is not None:
                seg.put(send.mvs)
        except BaseException:
            seg.end()
            raise
        header.shm = seg.name
        header.shm_in_offset = 0
        header.shm_out_offset = off
        return _ShmUse(lambda _, discard=False: seg.end(discard), None,
                       lambda n, recv: seg.get(off, n, recv))

    def _broken(self):
        """Why no answer will come any more (the membership failed, or this rank left),
        or None."""
        if self.failure is not None:
            return ParamsyncError(str(self.failure), self.failure.code, self.failure.details)
        return self._gone()

    def _gone(self):
        """Why the agent can no longer answer (nor write into this process): the
        membership stream to it ended, or this rank left; else None."""
        if self.leaving or (self.join_call is not None and self.pump is not None and
                            not self.pump.is_alive()):
            return ParamsyncError("lost the membership stream to the agent",
                                  grpc.StatusCode.UNAVAILABLE)
        return None

    def _doorbell_run(self, header, send, recv, what):
        """Runs a collective through the doorbell when it can: its payload in the doorbell
        when small, else in the segment or empty() memory (the agent permitting). Returns
        its result, or None (it takes a call)."""
        want = recv.total if recv is not None else 0
        small = (send.total if send is not None else 0) <= _shm.DB_PAYLOAD and \
            want <= _shm.DB_PAYLOAD
        d = self.doorbell.begin()
        if d is None:
            return None
        use = None
        abandoned = False
        try:
            if small:
                header.shm = d.name
                header.shm_out_offset = _shm.DB_OUT
            elif not d.segments:
                return None
            else:
                use = self._shm_begin(header, send, recv, rung=True)
                if use is None:
                    return None
            direct = use is not None and use.direct
            try:
                # Direct: the agent writes into the caller's buffers, so wait for its
                # answer even when the job broke (it fails the collective within about
                # a second); only an agent that is gone cannot answer.
                got = d.run(header, send.mvs if send is not None and small else [],
                            self._gone if direct else self._broken, direct=direct)
            except BaseException:
                abandoned = True
                raise
            finally:
                header.shm = header.shm_out = ""
                header.shm_process = False
                header.own_block = False
                header.shm_in_offset = 0
                header.shm_out_offset = 0
                del header.shm_in_blocks[:]
                del header.shm_out_blocks[:]
            if got is None:
                return None
            code, msg, source, out = got
            if code != 0:
                raise _error(what, _CODES.get(code, grpc.StatusCode.UNKNOWN), msg)
            if want:
                if out is None:
                    raise ParamsyncError("%s: the agent answered the doorbell without the "
                                         "output" % what, grpc.StatusCode.INTERNAL)
                if small:
                    recv.write(0, out[:want])
                else:
                    use.get(want, recv)
            return pb.CollectiveResult(source=source)
        finally:
            if use is not None:
                use.end(discard=abandoned)
            d.end()

    def check(self):
        if self.failure is not None:
            raise ParamsyncError(str(self.failure), self.failure.code, self.failure.details)

    def _small(self, g, header, seq, kind, dtype, send, recv, name, op=0):
        """A small collective of its own for a step of header's call, with sequence number
        seq: send and recv numpy arrays (recv may be send)."""
        h = pb.CollectiveHeader(job=self.job, group=g.id, seq=seq, kind=kind, op=op,
                                dtype=dtype, count=send.size, rank=header.rank,
                                timeout_ms=header.timeout_ms, incarnation=header.incarnation)
        self.run(g, h, T.Segments([T.view(send, "send")]),
                 T.Segments([T.view(recv, "recv", writable=True)]), name)

    def bar_run(self, g, header, k, name):
        """Barrier k (from 1) of g's barriers that may meet directly (_barrier). True when
        done; False when it is to go through the agent as any barrier."""
        b, n, me, seq = g._bar, g.size(), g.rank(), header.seq
        if k == 1:  # rank 0 makes the page; its name goes round as this barrier's call
            try:
                mine = np.frombuffer(b.make() if me == 0 else bytes(_barrier.NAME), np.uint8)
                got = np.zeros(n * _barrier.NAME, np.uint8)
                self._small(g, header, seq, _K.ALL_GATHER, T.UINT8, mine.copy(), got, name)
                if me != 0:
                    b.open(got[:_barrier.NAME])
            finally:
                b.ended(1)
            return True
        if k == 2:  # whether every rank mapped it, as this barrier's call
            b.wait_setup(1)
            ok = np.array([1 if b.words is not None else 0], np.int32)
            agreed = False
            try:
                self._small(g, header, seq, _K.ALL_REDUCE, T.INT32, ok, ok, name,
                            op=int(ReduceOp.MIN))
                agreed = ok[0] == 1
            finally:
                b.unlink()  # every rank tried to open it before it came here
                if not agreed:
                    b.close()  # through the agent for good
                b.ended(2)
            return True
        b.wait_setup(2)
        if b.words is None:
            return False
        timeout_ms = header.timeout_ms  # the World's, as every call's header has
        try:
            # False: a rank called another collective under this number; through the
            # agent, the hub fails both sides at once.
            return b.meet(me, n, (seq + 1) & 0xFFFFFFFF, time.monotonic() + timeout_ms / 1000.0,
                          self._broken)
        except TimeoutError:
            missing = b.missing(g.ranks, (seq + 1) & 0xFFFFFFFF)
            msg = "%s (group %d, seq %d): rank%s %s did not arrive within %d ms (met directly " \
                "on this host)" % (name, g.id, seq, "s" if len(missing) > 1 else "",
                                   ", ".join(map(str, missing)), timeout_ms)
            raise ParamsyncError(msg, grpc.StatusCode.DEADLINE_EXCEEDED) from None

    def peer_run(self, g, header, send, recv, name, copy_send, uneven=None):
        """Runs header's all_to_all, all_gather, gather or scatter by peer copies (_peer).
        True when done; False when it is to go through the agent, with header.seq the
        number it now goes under. uneven: an uneven all_to_all_single's blocks in the
        caller's tensors (_Uneven), read pair by pair instead of the padded send and recv."""
        n, rank, root, seq, kind = g.size(), g.rank(), header.root, header.seq, header.kind
        block = header.count * T.SIZES[header.dtype]
        nb = n if _peer.blocks_per_rank(kind) else 1
        # Memory from empty() the agent copies in place, between its mappings (where one
        # allocation holds input and output): faster than reads that pin its shared pages
        # one by one (client/peer.c). Not over the agent's --shm-resident-bytes: it would
        # copy through the segments' files. Asked of the buffers the agent would take: an
        # uneven all_to_all's are padded ones unless a side is the caller's own.
        agent_in_place = self.mem.in_place(send, recv, _peer.agent_touches(kind, n, block))
        if uneven is not None:
            send, recv, ins, outs = uneven.send, uneven.recv, uneven.ins, uneven.outs
        else:
            ins = _peer.block_addresses(send, _shm.addresses(send), nb, block) if send else []
            nout = 1 if kind == _K.SCATTER else n
            outs = _peer.block_addresses(recv, _shm.addresses(recv), nout, block) if recv \
                else []
        # torch's in-place forms: an all_gather's or gather root's input its own block of
        # the output, a scatter root's output its own block of the input. Any other
        # overlap would have ranks read what another already wrote.
        fits = ins is not None and outs is not None
        if fits and copy_send:
            fits = outs[0] == ins[rank] if kind == _K.SCATTER else (
                kind != _K.ALL_TO_ALL and ins[0] == outs[rank])
        fits = fits and not agent_in_place
        # PARAMSYNC_SHM=0 set since init (it is read on every collective): payloads over
        # gRPC, as asked.
        fits = fits and _shm.enabled()
        # An input that lies whole in an empty() segment kept open: the others map it.
        seg = None
        if fits and send and send.mvs and _peer.map_wanted():
            at = _shm.addresses(send)
            lo = min(at)
            seg = self.mem.file_of(lo, max(a + len(mv) for a, mv in zip(at, send.mvs)) - lo)
        desc = np.frombuffer(_peer.describe(self.peer_self, (ins or [0] * nb) if fits
                                            else [0] * nb, fits, seg), np.uint8)
        got = np.zeros(n * desc.size, np.uint8)
        self._small(g, header, seq, _K.ALL_GATHER, T.UINT8, desc, got,
                    "%s (peer addresses)" % name)
        d = _peer.all_fit(got.tobytes(), n, desc.size // 8)
        if d is None:
            header.seq = seq + 1
            return False
        for x in (send, recv):
            for at, mv in zip(_shm.addresses(x), x.mvs) if x else ():
                _shm.collapse(at, len(mv))
        ok = _peer.pull(kind, n, rank, root, d, desc.size // 8,
                        uneven.sizes if uneven is not None else block, outs, ins or [0] * nb,
                        self.peer_maps)
        failed = np.array([0 if ok else 1], np.int32)
        self._small(g, header, seq + 1, _K.ALL_REDUCE, T.INT32, failed, failed,
                    "%s (peer copies done)" % name, op=int(ReduceOp.MAX))
        if failed[0] == 0:
            with self.lock:
                self.peer_used += 1
            return True
        header.seq = seq + 2
        return False

    def run(self, g, header, send, recv, name, copy_send=False):
        """One Collective call: streams `send` (Segments) and fills `recv`. Returns the result.
        copy_send: `send` shares memory with `recv`; copied first if it goes as frames."""
        chunk = _chunk_bytes()
        what = "%s (group %d, seq %d)" % (name, g.id, header.seq)
        header.chunk_bytes = chunk
        self.check()
        result = self._doorbell_run(header, send, recv, what)
        if result is not None:
            return result
        shm = self._shm_begin(header, send, recv)
        if copy_send and shm is None:
            send = send.copy()

        def requests():
            # With shared memory the header travels alone.
            it = send.chunks(chunk) if send is not None and shm is None else iter(())
            data = next(it, b"")
            yield pb.Frame(header=header, data=data)
            off = len(data)
            for data in it:
                yield pb.Frame(offset=off, data=data)
                off += len(data)

        deadline = (header.timeout_ms or self.timeout_ms) / 1000.0 + 30
        want = recv.total if recv is not None else 0
        one = send is None or shm is not None or send.total <= chunk
        with self.lock:
            try:
                self.check()
                if one:
                    call = self.collective_one(next(requests()), timeout=deadline,
                                               metadata=self.md)
                else:
                    call = self.stub.Collective(requests(), timeout=deadline, metadata=self.md)
            except BaseException:
                if shm is not None:
                    shm.end()
                raise
            self.inflight.add(call)
        result = None
        got = 0
        in_shm = False
        over = False  # the call's status is in: the agent no longer reads the segment
        try:
            for frame in call:
                if frame.HasField("result") and result is None:
                    result = frame.result
                    if result.code != 0:
                        raise _error(what, _CODES.get(result.code, grpc.StatusCode.UNKNOWN),
                                     result.message)
                    if result.shm:
                        if shm is None:
                            call.cancel()
                            raise ParamsyncError("%s: the daemon answered in shared memory "
                                                 "this call did not use" % what,
                                                 grpc.StatusCode.INTERNAL)
                        if result.bytes != want:
                            call.cancel()
                            raise ParamsyncError(
                                "%s: the daemon announced %d result bytes; this rank expects %d"
                                % (what, result.bytes, want), grpc.StatusCode.DATA_LOSS)
                        in_shm = True
                if frame.data:
                    if recv is None or not recv.write(frame.offset, frame.data):
                        call.cancel()
                        raise ParamsyncError(
                            "%s: the daemon sent bytes %d..%d, beyond the %d expected"
                            % (what, frame.offset, frame.offset + len(frame.data),
                               recv.total if recv is not None else 0),
                            grpc.StatusCode.DATA_LOSS)
                    got += len(frame.data)
            over = True
            # The OK status decides: only now is the output in the segment the answer.
            if in_shm and want:
                shm.get(want, recv)
                got = want
        except grpc.RpcError as e:
            over = True
            if self.failure is not None and e.code() == grpc.StatusCode.CANCELLED:
                raise ParamsyncError("%s: %s" % (what, self.failure), self.failure.code,
                                     self.failure.details) from None
            raise _rpc_error(e, what) from None
        finally:
            with self.lock:
                self.inflight.discard(call)
            if shm is not None:
                if not over:
                    call.cancel()
                shm.end(discard=not over)
        if got != want:
            raise ParamsyncError("%s: received %d bytes, expected %d" % (what, got, want),
                                 grpc.StatusCode.DATA_LOSS)
        return result


class _ShmUse:
    """A collective's use of shared memory: get(n, recv) copies the n output bytes into
    recv (nothing for memory from empty(), where the agent wrote them in place), end()
    releases it once the call is over (discard: abandoned, the agent may still write)."""
    __slots__ = ("_end", "_mem", "_get", "direct")

    def __init__(self, end, mem, get, direct=False):
        self._end, self._mem, self._get = end, mem, get
        self.direct = direct  # the agent reads and writes the caller's own buffers

    def get(self, n, recv):
        if self._get is not None:
            self._get(n, recv)

    def end(self, discard=False):
        self._end(self._mem, discard=discard)


_world = None
_world_lock = threading.Lock()


# -- initialisation --------------------------------------------------------------------------


def is_available():
    return True


# torch's other backends are not part of paramsync: ported code that asks gets False.
def is_gloo_available():
    return False


def is_nccl_available():
    return False


def is_mpi_available():
    return False


def is_ucc_available():
    return False


def is_torchelastic_launched():
    """torch's test: whether torchrun (torchelastic) started this process."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def is_initialized():
    return _world is not None


def _env_int(name):
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError("$%s must be an integer, not %r" % (name, v)) from None


# The largest scratch buffer kept for the next call by default ($PARAMSYNC_SCRATCH_BYTES):
# as the C client's. One not kept is made anew, its pages faulted in again, every call.
_SCRATCH_BYTES = 1 << 30


def _scratch_bytes():
    v = _env_int("PARAMSYNC_SCRATCH_BYTES")
    if v is not None and v < 0:
        raise ValueError("$PARAMSYNC_SCRATCH_BYTES must be a number of bytes, not %r" % v)
    return _SCRATCH_BYTES if v is None else v


def _wait_for_file(path, timeout_s):
    """The daemon address in `path` (written by paramsyncd --announce-file), waiting for it."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                text = f.read()
            line = text.strip().splitlines()[0].strip() if text.strip() else ""
            if line and text.endswith("\n"):
                return line
        except FileNotFoundError:
            pass
        if time.monotonic() >= end:
            raise ParamsyncError("init_process_group: %s holds no daemon address after %.0f s "
                                 "(start paramsyncd --announce-file %s)" % (path, timeout_s, path),
                                 grpc.StatusCode.DEADLINE_EXCEEDED)
        time.sleep(0.05)


def _resolve(init_method, world_size, rank, group_name, join_timeout_s):
    """(address, job, world_size, rank) from the init method and the environment."""
    url = init_method or "env://"
    u = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(u.query).items()}
    job = query.get("job") or group_name or os.environ.get("PARAMSYNC_JOB") or None
    if u.scheme == "env":
        addr = os.environ.get("PARAMSYNC_ADDR")
        if not addr:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port:
                raise ValueError("env:// init: set PARAMSYNC_ADDR (the daemon's HOST:PORT), or "
                                 "MASTER_ADDR and MASTER_PORT (missing: %s)" % ", ".join(
                                     n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port))
                                     if not v))
            addr = "%s:%s" % (host, port)
    elif u.scheme == "tcp":
        if not u.hostname or not u.port:
            raise ValueError("tcp:// init method needs tcp://HOST:PORT, got %r" % url)
        addr = u.netloc
    elif u.scheme == "unix":
        addr = "unix:" + unquote(url[len("unix:"):].split("?")[0])
    elif u.scheme == "file":
        path = unquote(u.path)
        if not path:
            raise ValueError("file:// init method needs file:///PATH, got %r" % url)
        addr = _wait_for_file(path, join_timeout_s)
        job = job or path
    else:
        raise ValueError("unsupported init_method %r (env://, tcp://HOST:PORT, file:///PATH, "
                         "unix:PATH)" % url)
    if world_size is None or world_size < 0:
        world_size = int(query["world_size"]) if "world_size" in query else _env_int("WORLD_SIZE")
    if world_size is None:
        raise ValueError("world_size is not known: pass world_size= or set $WORLD_SIZE")
    if world_size < 1:
        raise ValueError("world_size must be at least 1, got %d" % world_size)
    if rank is None or rank < 0:
        rank = int(query["rank"]) if "rank" in query else _env_int("RANK")
        if rank is None:
            rank = -1  # the daemon assigns one
    if rank >= world_size:
        raise ValueError("rank %d is outside a world of %d" % (rank, world_size))
    return addr, job or "default", world_size, rank


def _ms(td):
    if isinstance(td, timedelta):
        return int(td.total_seconds() * 1000)
    return int(float(td) * 1000)


def init_process_group(backend=None, init_method=None, timeout=default_pg_timeout,
                       world_size=-1, rank=-1, store=None, group_name="", pg_options=None):
    """Joins the job and waits for all world_size ranks (torch's signature).

    backend: "paramsync" (or None). init_method: "env://" (default:
    $PARAMSYNC_ADDR, else $MASTER_ADDR:$MASTER_PORT; $WORLD_SIZE; $RANK),
    "tcp://HOST:PORT" (the daemon's address), "file:///PATH" (a file holding
    the daemon's address, as `paramsyncd --announce-file PATH` writes it;
    waited for), or "unix:PATH"; each takes "?job=NAME&world_size=N&rank=R".
    rank -1 with no $RANK lets the daemon assign one. timeout: the deadline of
    the rendezvous and of every collective (default 30 minutes; when left at
    the default, $PARAMSYNC_TIMEOUT_MS and $PARAMSYNC_JOIN_TIMEOUT_MS
    override it). group_name: the job id (see the module's doc)."""
    global _world
    if backend is not None and str(backend).lower() != Backend.PARAMSYNC:
        raise ValueError("paramsync.distributed runs the 'paramsync' backend, not %r "
                         "(torch.distributed provides %r)" % (backend, backend))
    if store is not None:
        raise ValueError("store= is not supported: the paramsync daemon is the rendezvous")
    with _world_lock:
        if _world is not None:
            raise RuntimeError("trying to initialize the default process group twice!")
        timeout_ms = _ms(timeout)
        join_ms = timeout_ms
        if timeout is default_pg_timeout:
            timeout_ms = _env_int("PARAMSYNC_TIMEOUT_MS") or timeout_ms
            join_ms = _env_int("PARAMSYNC_JOIN_TIMEOUT_MS") or timeout_ms
        if timeout_ms <= 0 or join_ms <= 0:
            raise ValueError("timeout must be positive")
        scratch_max = _scratch_bytes()
        addr, job, world_size, rank = _resolve(init_method, world_size, rank, group_name,
                                               join_ms / 1000.0)
        w = _World(addr, job, min(timeout_ms, 0xFFFFFFFF), scratch_max)
        try:
            w.join(world_size, rank, join_ms)
        except BaseException:
            w.channel.close()
            raise
        _world = w


def destroy_process_group(group=None):
    """Leaves the job (the default group) gracefully; a new init_process_group may follow.
    With a group other than the world, only forgets it."""
    global _world
    if group is not None and group is not GroupMember.WORLD:
        return
    with _world_lock:
        w, _world = _world, None
    if w is not None:
        w.leave(graceful=True)


def _excepthook(tp, value, tb):
    w = _world
    if w is not None:
        w.crashed = True
    _prev_excepthook(tp, value, tb)


_prev_excepthook = sys.excepthook
sys.excepthook = _excepthook


@atexit.register
def _at_exit():
    # A normal exit leaves gracefully; an uncaught exception breaks the stream
    # so that the other ranks hear MEMBER_LOST at once instead of timing out.
    w = _world
    if w is not None:
        w.leave(graceful=not w.crashed)


def _mp_child_exit():
    w = _world
    if w is not None:
        w.leave(graceful=not w.crashed)


try:  # multiprocessing children (fork) end with os._exit: leave from its finalizers too.
    import multiprocessing.util as _mpu
    _mpu.Finalize(None, _mp_child_exit, exitpriority=100)
except Exception:  # pragma: no cover
    pass


def _get_world():
    w = _world
    if w is None:
        raise RuntimeError("Default process group has not been initialized, please make sure "
                           "to call init_process_group.")
    return w


# -- groups ----------------------------------------------------------------------------------


def _group(g):
    """The ProcessGroup for a group argument, or None if the caller is not a member."""
    w = _get_world()
    if g is None or g is GroupMember.WORLD:
        return w.world_group
    if g is GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(g, ProcessGroup) or g._world is not w:
        raise ValueError("%r is not a group of this process group" % (g,))
    return g


def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
    """torch's new_group: every rank calls it, in the same order. Returns the group, or
    GroupMember.NON_GROUP_MEMBER for a rank not in `ranks` (job ranks)."""
    w = _get_world()
    w.check()
    if backend is not None and str(backend).lower() != Backend.PARAMSYNC:
        raise ValueError("new_group: backend %r is not 'paramsync'" % (backend,))
    ranks = list(range(w.size)) if ranks is None else [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError("new_group: ranks %s list a rank twice" % ranks)
    for r in ranks:
        if not 0 <= r < w.size:
            raise ValueError("new_group: rank %d is outside the world of %d" % (r, w.size))
    with w.lock:
        w.n_new_groups += 1
        gid = w.n_new_groups
    try:
        resp = w.stub.NewGroup(pb.NewGroupRequest(job=w.job, group=gid, ranks=ranks, rank=w.rank),
                               timeout=(w.timeout_ms / 1000.0) + 30, metadata=w.md)
    except grpc.RpcError as e:
        raise _rpc_error(e, "new_group (group %d, ranks %s)" % (gid, ranks)) from None
    if resp.group_rank < 0:
        return GroupMember.NON_GROUP_MEMBER
    return ProcessGroup(w, resp.group or gid, ranks, resp.group_rank)


def new_subgroups(group_size=None, group=None, timeout=None, backend=None, pg_options=None):
    """torch's new_subgroups: the world cut into groups of group_size consecutive ranks,
    every rank calling it. Returns (this rank's group, all of them). group_size has no
    default here (torch's is the CUDA device count)."""
    w = _get_world()
    if group_size is None:
        raise ValueError("new_subgroups: give group_size (torch's default, the CUDA device "
                         "count, has no meaning for paramsync)")
    if group is not None and group is not GroupMember.WORLD:
        raise ValueError("new_subgroups: only subgroups of the world are supported")
    group_size = int(group_size)
    if group_size <= 0:
        raise ValueError("The arg 'group_size' must be greater than 0")
    if group_size > w.size:
        raise ValueError("The arg 'group_size' must not exceed the world size")
    if w.size % group_size:
        raise ValueError("The world size must be divisible by 'group_size'")
    return new_subgroups_by_enumeration(
        [list(range(k, k + group_size)) for k in range(0, w.size, group_size)],
        timeout=timeout, backend=backend, pg_options=pg_options)


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None,
                                 pg_options=None):
    """torch's new_subgroups_by_enumeration: a group for each list of ranks (a rank in one
    at most), every rank calling it. Returns (this rank's group or None, all of them)."""
    w = _get_world()
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    first = {}
    for ranks in ranks_per_subgroup_list:  # checked before any group is made
        for r in ranks:
            if r in first:
                raise ValueError("Rank {} has appeared in both subgroup {} and {}".format(
                    r, first[r], ranks))
            first[r] = ranks
    subgroups, mine = [], None
    for ranks in ranks_per_subgroup_list:
        g = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options)
        subgroups.append(g)
        if w.rank in ranks:
            mine = g
    return mine, subgroups


def get_rank(group=None):
    """The caller's rank in group (default: the job); -1 if it is not a member."""
    g = _group(group)
    return -1 if g is None else g.rank()


def get_world_size(group=None):
    """The size of group (default: the job); -1 for a group the caller is not in."""
    g = _group(group)
    return -1 if g is None else g.size()


def get_backend(group=None):
    _group(group)
    return Backend.PARAMSYNC


def get_process_group_ranks(group):
    g = _group(group)
    if g is None:
        raise ValueError("not a member of the group")
    return list(g.ranks)


def get_global_rank(group, group_rank):
    g = _group(group)
    if g is None or not 0 <= group_rank < g.size():
        raise ValueError("group rank %r is not in the group" % (group_rank,))
    return g.ranks[group_rank]


def get_group_rank(group, global_rank):
    g = _group(group)
    if g is None or global_rank not in g.ranks:
        raise ValueError("global rank %r is not part of the group" % (global_rank,))
    return g.ranks.index(global_rank)


# -- collectives -----------------------------------------------------------------------------

_K = pb.CollectiveKind


# -- memory the daemon uses in place ----------------------------------------------------------


def empty(shape, dtype="float32"):
    """An uninitialised-looking (in fact zeroed) tensor of `shape` whose memory the daemon
    reads and writes in place: a collective whose input and output both lie in one such
    tensor copies nothing in this process (the C client's ps_mem_alloc). A numpy array for a
    numpy dtype (or its name), a torch tensor for a torch dtype. Each is a shared-memory
    segment of its own, at most 64 per rank shared with the daemon; past that, or when the
    daemon cannot map it (another host, PARAMSYNC_SHM=0), it is plain memory and collectives
    copy as usual (is_shared tells). One collective at a time uses it in place; another at
    the same time copies. Lives until free() or destroy_process_group(), and the memory for
    as long as the tensor does."""
    import numpy as np
    w = _get_world()
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    n = 1
    for d in shape:
        if int(d) < 0:
            raise ValueError("empty: negative dimension in %r" % (shape,))
        n *= int(d)
    torch = T._torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        T.to_wire(dtype)  # TypeError for what paramsync cannot carry
        size = torch.empty((), dtype=dtype).element_size()
        mem = w.mem.alloc(n * size)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mem.map, dtype=dtype, count=n).reshape(shape)
    nd = T.from_wire(T.to_wire(dtype))
    mem = w.mem.alloc(n * np.dtype(nd).itemsize)
    return np.frombuffer(mem.map, dtype=nd, count=n).reshape(shape)


def _address(tensor, what):
    return _shm.address(T.view(tensor, what).mv)


def free(tensor):
    """Gives the memory of a tensor from empty() back to the daemon (the tensor stays usable
    as plain memory for as long as it lives). ValueError for a tensor not from empty(), or
    one a collective still uses."""
    w = _get_world()
    if not w.mem.free(_address(tensor, "free")):
        raise ValueError("free: not a tensor from paramsync.distributed.empty() (its first "
                         "element), or a collective still uses it")


def is_shared(tensor):
    """Whether the daemon reads and writes tensor's memory in place (memory from empty() that
    the daemon could map)."""
    w = _get_world()
    buf = T.view(tensor, "is_shared")
    if not buf.nbytes:
        return False
    mem = w.mem.find(_shm.address(buf.mv), buf.nbytes)
    return mem is not None and mem.name is not None


def _member(group, name):
    g = _group(group)
    if g is None:
        warnings.warn("Running %s on global rank %d which does not belong to the given group."
                      % (name, _get_world().rank), stacklevel=3)
    return g


def _group_rank(g, global_rank, what):
    try:
        global_rank = int(global_rank)
    except (TypeError, ValueError):
        raise ValueError("%s must be a rank, not %r" % (what, global_rank)) from None
    if global_rank not in g.ranks:
        raise ValueError("%s: the global rank %d is not part of the group (ranks %s)"
                         % (what, global_rank, g.ranks))
    return g.ranks.index(global_rank)


def _op(op, dtype, name):
    try:
        op = ReduceOp(int(op))
    except (TypeError, ValueError):
        raise ValueError("%s: op must be a ReduceOp, not %r" % (name, op)) from None
    if op in _BITWISE and dtype in T.FLOATING:
        raise TypeError("%s: ReduceOp.%s is not defined on %s tensors" % (name, op.name,
                                                                          T.NAMES[dtype]))
    return op


def _same(bufs, ref, name, what):
    for i, b in enumerate(bufs):
        if b.dtype != ref.dtype:
            raise TypeError("%s: %s[%d] is %s but the tensor is %s (one dtype per collective)"
                            % (name, what, i, T.NAMES[b.dtype], T.NAMES[ref.dtype]))
        if b.numel != ref.numel:
            raise ValueError("%s: %s[%d] has %d elements but the tensor has %d"
                             % (name, what, i, b.numel, ref.numel))


def _list(obj, name, what, n):
    if not isinstance(obj, (list, tuple)):
        raise TypeError("%s: %s must be a list of tensors, not %s"
                        % (name, what, type(obj).__name__))
    if len(obj) != n:
        raise ValueError("%s: %s has %d tensors; the group has %d ranks"
                         % (name, what, len(obj), n))
    return [T.view(t, "%s[%d]" % (what, i), writable=True) for i, t in enumerate(obj)]


def _start(g, name, kind, *, send=(), recv=(), op=0, dtype=0, count=0, root=0, peer=0, tag=0,
           async_op=False, outputs=None, source=False, timeout_ms=None, uneven=None):
    """Assigns the sequence number now (program order) and runs the call, or starts it.
    timeout_ms: this call's deadline instead of the World's. uneven: the _Uneven of an
    all_to_all_single with split sizes, whose padded send is filled only on the way to
    the agent."""
    w = g._world
    w.check()
    send_segs = T.Segments(send) if send else None
    copy_send = isinstance(send, _Aliased)
    recv_segs = T.Segments(recv) if recv else None
    # Peer copies hold three sequence numbers (_peer). Decided from what every rank of the
    # group has alike: the kind, the block's bytes, the coordinator's sets.
    peer_copies = _peer.takes(int(kind), count * T.SIZES.get(dtype, 0), w.peer_sets, g.ranks,
                              w.rank)
    # Direct barriers (_barrier), counted per group, alike on every rank.
    direct = kind == _K.BARRIER and _barrier.takes(w.barrier_sets, g.ranks, w.rank)
    bar_k = 0
    with w.lock:
        if direct:
            g._bar.calls += 1
            bar_k = g._bar.calls
        if kind == _K.SEND:
            seq = g._send_seq.get(peer, 0)
            g._send_seq[peer] = seq + 1
        elif kind == _K.RECV:
            seq = g._recv_seq
            g._recv_seq += 1
        else:
            seq = g._seq
            g._seq += _peer.SEQS if peer_copies else 1
            if not direct:
                g._bar.started(g.rank(), seq)
    header = pb.CollectiveHeader(job=w.job, group=g.id, seq=seq, kind=kind, op=int(op),
                                 dtype=dtype, count=count, root=root, peer=peer, rank=g.rank(),
                                 tag=tag, timeout_ms=timeout_ms or w.timeout_ms,
                                 incarnation=w.incarnation)
    if uneven is not None:  # the agents need not move the padding, nor count it
        header.block_used.extend(uneven.block_used())
        header.block_out_used.extend(uneven.block_out_used())

    def run():
        if peer_copies and w.peer_run(g, header, send_segs, recv_segs, name, copy_send,
                                      uneven):
            return None
        if uneven is not None:
            uneven.pack()
        if bar_k and w.bar_run(g, header, bar_k, name):
            return None
        result = w.run(g, header, send_segs, recv_segs, name, copy_send)
        if source:
            src = result.source if result is not None else -1
            return g.ranks[src] if 0 <= src < g.size() else src
        return None

    if async_op:
        return Work(run, outputs)
    return run()


class _Aliased(list):
    """Inputs that share memory with the call's outputs (see _snapshot)."""


def _snapshot(inputs, outputs):
    """Marks inputs that share memory with outputs. Sent as gRPC frames they are copied
    first (World.run), so that results cannot overwrite bytes not yet sent; through shared
    memory they are in the segment before any result exists, and are not copied."""
    return _Aliased(inputs) if T.overlaps(inputs, outputs) else inputs


def barrier(group=None, async_op=False, device_ids=None):
    g = _member(group, "barrier")
    if g is None:
        return None
    return _start(g, "barrier", _K.BARRIER, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """Copies src's tensor (src: a global rank) into every rank's tensor, in place."""
    g = _member(group, "broadcast")
    if g is None:
        return None
    b = T.view(tensor, "tensor", writable=True)
    root = _group_rank(g, src, "broadcast: src")
    me = g.rank()
    return _start(g, "broadcast", _K.BROADCAST, send=[b] if me == root else (),
                  recv=[b] if me != root else (), dtype=b.dtype, count=b.numel, root=root,
                  async_op=async_op, outputs=[tensor])


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor across the group; every rank gets the result in place."""
    g = _member(group, "all_reduce")
    if g is None:
        return None
    b = T.view(tensor, "tensor", writable=True)
    op = _op(op, b.dtype, "all_reduce")
    return _start(g, "all_reduce", _K.ALL_REDUCE, send=[b], recv=[b], op=op, dtype=b.dtype,
                  count=b.numel, async_op=async_op, outputs=[tensor])


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor across the group into dst's tensor (dst: a global rank)."""
    g = _member(group, "reduce")
    if g is None:
        return None
    b = T.view(tensor, "tensor", writable=True)
    op = _op(op, b.dtype, "reduce")
    root = _group_rank(g, dst, "reduce: dst")
    return _start(g, "reduce", _K.REDUCE, send=[b], recv=[b] if g.rank() == root else (),
                  op=op, dtype=b.dtype, count=b.numel, root=root, async_op=async_op,
                  outputs=[tensor])


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[i] gets rank i's tensor, on every rank."""
    g = _member(group, "all_gather")
    if g is None:
        return None
    b = T.view(tensor, "tensor")
    outs = _list(tensor_list, "all_gather", "tensor_list", g.size())
    _same(outs, b, "all_gather", "tensor_list")
    send = _snapshot([b], outs)
    return _start(g, "all_gather", _K.ALL_GATHER, send=send, recv=outs, dtype=b.dtype,
                  count=b.numel, async_op=async_op, outputs=list(tensor_list))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output_tensor (n times input's size) gets every rank's input_tensor in rank order."""
    g = _member(group, "all_gather_into_tensor")
    if g is None:
        return None
    b = T.view(input_tensor, "input_tensor")
    o = T.view(output_tensor, "output_tensor", writable=True)
    if o.dtype != b.dtype:
        raise TypeError("all_gather_into_tensor: output is %s, input %s"
                        % (T.NAMES[o.dtype], T.NAMES[b.dtype]))
    if o.numel != b.numel * g.size():
        raise ValueError("all_gather_into_tensor: output has %d elements, need %d x %d"
                         % (o.numel, g.size(), b.numel))
    send = _snapshot([b], [o])
    return _start(g, "all_gather_into_tensor", _K.ALL_GATHER, send=send, recv=[o],
                  dtype=b.dtype, count=b.numel, async_op=async_op, outputs=[output_tensor])


_all_gather_base = all_gather_into_tensor


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """On dst (a global rank), gather_list[i] gets rank i's tensor; others pass no list."""
    g = _member(group, "gather")
    if g is None:
        return None
    b = T.view(tensor, "tensor")
    root = _group_rank(g, dst, "gather: dst")
    outs = ()
    if g.rank() == root:
        if gather_list is None:
            raise ValueError("gather: Argument ``gather_list`` must be specified on destination "
                             "rank.")
        outs = _list(gather_list, "gather", "gather_list", g.size())
        _same(outs, b, "gather", "gather_list")
    elif gather_list:
        raise ValueError("gather: Argument ``gather_list`` must NOT be specified on "
                         "non-destination ranks.")
    send = _snapshot([b], outs)
    return _start(g, "gather", _K.GATHER, send=send, recv=outs, dtype=b.dtype, count=b.numel,
                  root=root, async_op=async_op, outputs=list(gather_list or []))


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """Rank i's tensor gets scatter_list[i] of src (a global rank); others pass no list."""
    g = _member(group, "scatter")
    if g is None:
        return None
    b = T.view(tensor, "tensor", writable=True)
    root = _group_rank(g, src, "scatter: src")
    ins = ()
    if g.rank() == root:
        if scatter_list is None:
            raise ValueError("scatter: Argument ``scatter_list`` must be specified on source "
                             "rank.")
        ins = _list(scatter_list, "scatter", "scatter_list", g.size())
        _same(ins, b, "scatter", "scatter_list")
        ins = _snapshot(ins, [b])
    elif scatter_list:
        raise ValueError("scatter: Argument ``scatter_list`` must NOT be specified on "
                         "non-source ranks.")
    return _start(g, "scatter", _K.SCATTER, send=ins, recv=[b], dtype=b.dtype, count=b.numel,
                  root=root, async_op=async_op, outputs=[tensor])


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Rank i's output gets the reduction of every rank's input_list[i]."""
    g = _member(group, "reduce_scatter")
    if g is None:
        return None
    o = T.view(output, "output", writable=True)
    ins = _list(input_list, "reduce_scatter", "input_list", g.size())
    _same(ins, o, "reduce_scatter", "input_list")
    op = _op(op, o.dtype, "reduce_scatter")
    ins = _snapshot(ins, [o])
    return _start(g, "reduce_scatter", _K.REDUCE_SCATTER, send=ins, recv=[o], op=op,
                  dtype=o.dtype, count=o.numel, async_op=async_op, outputs=[output])


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """reduce_scatter with the input as one tensor of n blocks."""
    g = _member(group, "reduce_scatter_tensor")
    if g is None:
        return None
    o = T.view(output, "output", writable=True)
    i = T.view(input, "input")
    if o.dtype != i.dtype:
        raise TypeError("reduce_scatter_tensor: output is %s, input %s"
                        % (T.NAMES[o.dtype], T.NAMES[i.dtype]))
    if i.numel != o.numel * g.size():
        raise ValueError("reduce_scatter_tensor: input has %d elements, need %d x %d"
                         % (i.numel, g.size(), o.numel))
    op = _op(op, o.dtype, "reduce_scatter_tensor")
    send = _snapshot([i], [o])
    return _start(g, "reduce_scatter_tensor", _K.REDUCE_SCATTER, send=send, recv=[o], op=op,
                  dtype=o.dtype, count=o.numel, async_op=async_op, outputs=[output])


_reduce_scatter_base = reduce_scatter_tensor


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """output_tensor_list[j] gets rank j's input_tensor_list[rank]. Blocks must be equal-sized."""
    g = _member(group, "all_to_all")
    if g is None:
        return None
    if T.is_tensor(output_tensor_list) or T.is_tensor(input_tensor_list):
        raise TypeError("all_to_all takes lists of tensors (use all_to_all_single for tensors)")
    outs = _list(output_tensor_list, "all_to_all", "output_tensor_list", g.size())
    ins = _list(input_tensor_list, "all_to_all", "input_tensor_list", g.size())
    _same(outs, ins[0], "all_to_all", "output_tensor_list")
    _same(ins, ins[0], "all_to_all", "input_tensor_list")
    ins = _snapshot(ins, outs)
    return _start(g, "all_to_all", _K.ALL_TO_ALL, send=ins, recv=outs, dtype=ins[0].dtype,
                  count=ins[0].numel, async_op=async_op, outputs=list(output_tensor_list))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Block j of output (split along the first dimension) gets rank j's block `rank` of
    input. Without split sizes the blocks are equal; with them (rows of the first
    dimension, torch's uneven form; every rank gives them, or none does) each rank's
    input_split_sizes[j] must be what rank j expects in its output_split_sizes[rank]."""
    g = _member(group, "all_to_all_single")
    if g is None:
        return None
    o = T.view(output, "output", writable=True)
    i = T.view(input, "input")
    n = g.size()
    if o.dtype != i.dtype:
        raise TypeError("all_to_all_single: output is %s, input %s (one dtype per collective)"
                        % (T.NAMES[o.dtype], T.NAMES[i.dtype]))
    if _given(output_split_sizes) or _given(input_split_sizes):
        # Decided by whether sizes are given, never by their values: splits that look
        # equal on one rank can be uneven on another, and all must take the same steps.
        row = _row_elements(input, output)
        ins = _splits(input_split_sizes, input, n, "input")
        outs = _splits(output_split_sizes, output, n, "output")
        return _uneven_all_to_all(g, o, i, ins, outs, row, async_op, output)
    if i.numel != o.numel or i.numel % n:
        raise ValueError("all_to_all_single: input (%d elements) and output (%d) must be the "
                         "same size, a multiple of the group size %d (or give split sizes)"
                         % (i.numel, o.numel, n))
    send = _snapshot([i], [o])
    return _start(g, "all_to_all_single", _K.ALL_TO_ALL, send=send, recv=[o], dtype=i.dtype,
                  count=i.numel // n, async_op=async_op, outputs=[output])


def _given(sizes):
    return sizes is not None and len(sizes) > 0


def _rows(tensor):
    shape = tuple(tensor.shape)
    if not shape:
        raise ValueError("all_to_all_single: split sizes need tensors of one dimension or more")
    return shape


def _row_elements(input, output):
    """Elements of one row (one index of the first dimension), alike in input and output."""
    ri, ro = _rows(input)[1:], _rows(output)[1:]
    if ri != ro:
        raise ValueError("all_to_all_single: input rows are %s and output rows %s; they must "
                         "be alike" % (ri, ro))
    return int(np.prod(ri, dtype=np.int64))


def _splits(sizes, tensor, n, what):
    """Rows per rank: sizes as ints, checked against the tensor, or equal rows."""
    rows = _rows(tensor)[0]
    if not _given(sizes):
        if rows % n:
            raise ValueError("all_to_all_single: %s has %d rows, not a multiple of the group "
                             "size %d (give %s_split_sizes)" % (what, rows, n, what))
        return [rows // n] * n
    sizes = [int(k) for k in sizes]
    if len(sizes) != n:
        raise ValueError("all_to_all_single: %s_split_sizes has %d sizes; the group has %d "
                         "ranks" % (what, len(sizes), n))
    if min(sizes) < 0 or sum(sizes) != rows:
        raise ValueError("all_to_all_single: %s_split_sizes %s must be rows >= 0 adding up to "
                         "the %s's %d" % (what, sizes, what, rows))
    return sizes


def _uneven_all_to_all(g, o, i, ins, outs, row, async_op, output):
    """torch's all_to_all_single with uneven splits, on the daemon's equal blocks: every
    rank's split sizes first (one all_gather, so that every rank checks every pair alike
    and all fail together), then each block padded to the largest. The data's call is
    started (its sequence number taken) before this returns, as any collective's."""
    n = g.size()
    table = np.zeros(2 * n * n, np.int64)
    _step(g, "all_to_all_single", _K.ALL_GATHER, send=[np.array(ins + outs, np.int64)],
          recv=[table], dtype=T.INT64, count=2 * n)
    t = table.reshape(n, 2, n)  # per rank: its input_split_sizes, then its output's
    sent, expected = t[:, 0, :], t[:, 1, :]
    bad = np.argwhere(sent != expected.T)
    if bad.size:
        a, b = (int(k) for k in bad[0])
        raise ValueError("all_to_all_single: group rank %d sends %d rows to group rank %d, "
                         "whose output_split_sizes expect %d" % (a, sent[a, b], b,
                                                                 expected[b, a]))
    esize = T.SIZES[i.dtype]
    most = int(sent.max())
    m = most * row * esize  # a padded block's bytes
    # A side whose blocks are all of the largest size needs no padding: the call reads or
    # writes the tensor itself (the call's shape is the same on every rank either way).
    # Padding bytes are never read, so the padded buffers are not cleared; where the
    # ranks read each other (peer copies) they are never written either.
    world = g._world
    shared = np.shares_memory(i.arr, o.arr)
    own_in = ins == [most] * n
    own_out = outs == [most] * n and not (own_in and shared)
    # Where the ranks may copy rank to rank the padded blocks are never touched: plain
    # memory, whose pages are not even mapped. Elsewhere the call goes through the agents,
    # which take padded blocks on empty() memory in place (as the C client's
    # ps__scratch_take).
    reg = not _peer.one_set(world.peer_sets, g.ranks, world.rank)
    kept = [None if own_in else world.scratch(n * m, reg),
            None if own_out else world.scratch(n * m, reg)]
    src = i.arr if own_in else kept[0][:n * m]
    dst = o.arr if own_out else kept[1][:n * m]
    u = _Uneven(i, o, ins, outs, row * esize, m, None if own_in else src,
                None if own_out else dst, not shared)

    try:
        w = _step(g, "all_to_all_single", _K.ALL_TO_ALL, send=[src], recv=[dst],
                  dtype=T.UINT8, count=m, async_op=async_op, outputs=[output], uneven=u)
    except BaseException:
        world.scratch_give(*kept, registered=reg, keep=False)
        raise
    if not async_op:
        u.unpack()
        world.scratch_give(*kept, registered=reg)
        return None

    def finish():
        ok = False
        try:
            w.wait()
            u.unpack()
            ok = True
        finally:
            world.scratch_give(*kept, registered=reg, keep=ok)

    return Work(finish, outputs=[output])


class _Uneven:
    """An uneven all_to_all_single's blocks where they lie in the caller's tensors i and o
    (ins and outs: rows of `row` bytes to and from each rank), which peer copies read and
    write pair by pair (World.peer_run: sizes, the bytes this rank takes from each rank;
    ins and outs None where input and output are not apart), and, when the call goes
    through the agent instead, the padded blocks of m bytes it moves (pad_in, pad_out;
    None for a side sent or received as the tensor itself): pack() fills pad_in and marks
    via_agent, unpack() then takes the output out of pad_out."""
    __slots__ = ("send", "recv", "ins", "outs", "sizes", "via_agent", "_i", "_o", "_in_rows",
                 "_out_rows", "_row", "_m", "_pad_in", "_pad_out")

    def __init__(self, i, o, ins, outs, row, m, pad_in, pad_out, apart):
        self.send, self.recv = T.Segments([i]), T.Segments([o])
        self.ins = self._at(self.send, ins, row) if apart else None
        self.outs = self._at(self.recv, outs, row) if apart else None
        self.sizes = [k * row for k in outs]
        self.via_agent = False
        self._i, self._o, self._in_rows, self._out_rows = i, o, ins, outs
        self._row, self._m, self._pad_in, self._pad_out = row, m, pad_in, pad_out

    @staticmethod
    def _at(segs, rows, row):
        base = _shm.addresses(segs)[0] if segs.mvs else 0
        at = list(np.cumsum([0] + rows[:-1], dtype=np.int64) * row)
        return [base + int(k) for k in at]

    def _copy(self, pad, flat, rows, to_pad):
        """The blocks of flat (rows per rank) into pad's blocks of m bytes, or back."""
        at = 0
        for j, k in enumerate(rows if pad is not None else ()):
            b = k * self._row
            if to_pad:
                pad[j * self._m:j * self._m + b] = flat[at:at + b]
            else:
                flat[at:at + b] = pad[j * self._m:j * self._m + b]
            at += b

    def block_used(self):
        """The bytes of each padded input block that are data (CollectiveHeader.block_used);
        none where the input goes as it is."""
        return [] if self._pad_in is None else [k * self._row for k in self._in_rows]

    def block_out_used(self):
        """The same of each padded output block (CollectiveHeader.block_out_used)."""
        return [] if self._pad_out is None else [k * self._row for k in self._out_rows]

    def pack(self):
        self.via_agent = True
        self._copy(self._pad_in, self._i.arr, self._in_rows, True)

    def unpack(self):
        if self.via_agent:
            self._copy(self._pad_out, self._o.arr, self._out_rows, False)


def _step(g, name, kind, send=(), recv=(), **kw):
    """One collective of numpy arrays made here (the sizes and padded bytes of the object
    collectives and of an uneven all_to_all_single), named in errors by the call it serves."""
    return _start(g, name, kind, send=[T.view(a, name) for a in send],
                  recv=[T.view(a, name, writable=True) for a in recv], **kw)


# ------------------------------------------------------- Python objects, pickled as torch does
# torch's object collectives: each object is pickled into a uint8 tensor and moved by
# the collectives above, sizes first. The same warning as torch's applies: unpickling
# runs code from the bytes, so only use them among ranks you trust.


def _pickled(obj):
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8)


def _unpickled(buf, size, name, rank):
    try:
        return pickle.loads(buf[:int(size)].tobytes())
    except Exception as e:
        raise ValueError("%s: the object from rank %d could not be unpickled (%s: %s); every "
                         "rank must pass objects pickled by Python" % (name, rank,
                                                                       type(e).__name__, e)) \
            from None


def _object_list(obj, name, what, n):
    if not isinstance(obj, list):
        raise TypeError("%s: %s must be a list, not %s" % (name, what, type(obj).__name__))
    if n is not None and len(obj) != n:
        raise ValueError("%s: %s has %d elements; the group has %d ranks"
                         % (name, what, len(obj), n))


def _gathered_sizes(g, data, name):
    """Every rank's pickle size, in group rank order (one all_gather of int64s)."""
    sizes = np.zeros(g.size(), np.int64)
    _step(g, name, _K.ALL_GATHER, send=[np.array([data.size], np.int64)], recv=[sizes],
          dtype=T.INT64, count=1)
    return sizes


def _padded(data, m):
    buf = np.zeros(m, np.uint8)
    buf[:data.size] = data
    return buf


def all_gather_object(object_list, obj, group=None):
    """object_list[i] gets rank i's obj (pickled), on every rank; object_list must have one
    element per rank of the group."""
    g = _member(group, "all_gather_object")
    if g is None:
        return None
    n = g.size()
    _object_list(object_list, "all_gather_object", "object_list", n)
    data = _pickled(obj)
    sizes = _gathered_sizes(g, data, "all_gather_object")
    m = int(sizes.max())
    out = np.empty(n * m, np.uint8)
    _step(g, "all_gather_object", _K.ALL_GATHER, send=[_padded(data, m)], recv=[out],
          dtype=T.UINT8, count=m)
    for i in range(n):
        object_list[i] = _unpickled(out[i * m:], sizes[i], "all_gather_object", g.ranks[i])
    return None


def gather_object(obj, object_gather_list=None, dst=0, group=None):
    """On dst (a global rank), object_gather_list[i] gets rank i's obj (pickled); the other
    ranks pass no list."""
    g = _member(group, "gather_object")
    if g is None:
        return None
    n = g.size()
    root = _group_rank(g, dst, "gather_object: dst")
    if g.rank() == root:
        if object_gather_list is None:
            raise ValueError("gather_object: Argument ``object_gather_list`` must be specified "
                             "on destination rank.")
        _object_list(object_gather_list, "gather_object", "object_gather_list", n)
    elif object_gather_list:
        raise ValueError("gather_object: Argument ``object_gather_list`` must NOT be specified "
                         "on non-destination ranks.")
    data = _pickled(obj)
    sizes = _gathered_sizes(g, data, "gather_object")
    m = int(sizes.max())
    outs = [np.empty(m, np.uint8) for _ in range(n)] if g.rank() == root else None
    _step(g, "gather_object", _K.GATHER, send=[_padded(data, m)], recv=outs or (),
          dtype=T.UINT8, count=m, root=root)
    if outs is not None:
        for i in range(n):
            object_gather_list[i] = _unpickled(outs[i], sizes[i], "gather_object", g.ranks[i])
    return None


def broadcast_object_list(object_list, src=0, group=None, device=None):
    """Every rank's object_list gets src's objects (pickled), in place; every rank passes a
    list of the same length. device is accepted for torch's signature and not used."""
    g = _member(group, "broadcast_object_list")
    if g is None:
        return None
    root = _group_rank(g, src, "broadcast_object_list: src")
    _object_list(object_list, "broadcast_object_list", "object_list", None)
    mine = g.rank() == root
    datas = [_pickled(o) for o in object_list] if mine else []
    sizes = np.array([d.size for d in datas] if mine else [0] * len(object_list), np.int64)
    # The sizes go even for an empty list: the daemon compares the ranks' lengths.
    _step(g, "broadcast_object_list", _K.BROADCAST, send=[sizes] if mine else (),
          recv=() if mine else [sizes], dtype=T.INT64, count=sizes.size, root=root)
    if not sizes.size:
        return None
    buf = np.concatenate(datas) if mine else np.empty(int(sizes.sum()), np.uint8)
    _step(g, "broadcast_object_list", _K.BROADCAST, send=[buf] if mine else (),
          recv=() if mine else [buf], dtype=T.UINT8, count=buf.size, root=root)
    if not mine:
        at = 0
        for i, size in enumerate(sizes):
            object_list[i] = _unpickled(buf[at:], size, "broadcast_object_list", src)
            at += int(size)
    return None


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=0,
                        group=None):
    """scatter_object_output_list[0] of rank i gets src's scatter_object_input_list[i]
    (pickled); src is a global rank, and the other ranks' input lists are not read."""
    g = _member(group, "scatter_object_list")
    if g is None:
        return None
    n = g.size()
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a list of "
                         "at least one element")
    root = _group_rank(g, src, "scatter_object_list: src")
    mine = g.rank() == root
    if mine:
        if scatter_object_input_list is None:
            raise ValueError("scatter_object_list: Argument ``scatter_object_input_list`` "
                             "must be specified on the source rank.")
        _object_list(scatter_object_input_list, "scatter_object_list",
                     "scatter_object_input_list", n)
        datas = [_pickled(o) for o in scatter_object_input_list]
        m = max(d.size for d in datas)
        # Each rank gets its size and the largest: one scatter of int64 pairs.
        heads = [np.array([d.size, m], np.int64) for d in datas]
    head = np.zeros(2, np.int64)
    _step(g, "scatter_object_list", _K.SCATTER, send=heads if mine else (), recv=[head],
          dtype=T.INT64, count=2, root=root)
    m = int(head[1])
    out = np.empty(m, np.uint8)
    _step(g, "scatter_object_list", _K.SCATTER,
          send=[_padded(d, m) for d in datas] if mine else (), recv=[out], dtype=T.UINT8,
          count=m, root=root)
    scatter_object_output_list[0] = _unpickled(out, head[0], "scatter_object_list", src)
    return None


def _p2p_peer(g, rank, what):
    peer = _group_rank(g, rank, what)
    if peer == g.rank():
        raise ValueError("%s: a rank cannot send to or receive from itself" % what)
    return peer


def _tag(tag):
    tag = int(tag)
    if not 0 <= tag <= 0xFFFFFFFF:
        raise ValueError("tag must be a non-negative 32-bit integer, got %d" % tag)
    return tag


def isend(tensor, dst, group=None, tag=0):
    """Starts sending tensor to dst (a global rank); returns a Work."""
    g = _member(group, "isend")
    if g is None:
        return None
    b = T.view(tensor, "tensor")
    peer = _p2p_peer(g, dst, "isend: dst")
    return _start(g, "send", _K.SEND, send=[b], dtype=b.dtype, count=b.numel, peer=peer,
                  tag=_tag(tag), async_op=True, outputs=[])


def send(tensor, dst, group=None, tag=0):
    """Sends tensor to dst (a global rank); returns when the daemon has taken it."""
    g = _member(group, "send")
    if g is None:
        return None
    b = T.view(tensor, "tensor")
    peer = _p2p_peer(g, dst, "send: dst")
    _start(g, "send", _K.SEND, send=[b], dtype=b.dtype, count=b.numel, peer=peer, tag=_tag(tag))


def irecv(tensor, src=None, group=None, tag=0):
    """Starts receiving into tensor from src (a global rank; None: any). The Work's
    source_rank() gives the sender once done."""
    g = _member(group, "irecv")
    if g is None:
        return None
    b = T.view(tensor, "tensor", writable=True)
    peer = -1 if src is None else _p2p_peer(g, src, "irecv: src")
    return _start(g, "recv", _K.RECV, recv=[b], dtype=b.dtype, count=b.numel, peer=peer,
                  tag=_tag(tag), async_op=True, outputs=[tensor], source=True)


def recv(tensor, src=None, group=None, tag=0):
    """Receives into tensor from src (a global rank; None: any). Returns the sender's rank."""
    g = _member(group, "recv")
    if g is None:
        return -1
    b = T.view(tensor, "tensor", writable=True)
    peer = -1 if src is None else _p2p_peer(g, src, "recv: src")
    return _start(g, "recv", _K.RECV, recv=[b], dtype=b.dtype, count=b.numel, peer=peer,
                  tag=_tag(tag), source=True)


class P2POp:
    """One operation for batch_isend_irecv: P2POp(isend, tensor, peer) or P2POp(irecv, ...)."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        if op not in (isend, irecv):
            raise ValueError("P2POp: op must be paramsync.distributed.isend or irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    """Starts every operation of the list (in order); returns their Works."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier with a deadline of its own (timeout: a timedelta or seconds; default the
    process group's): a rank missing by then fails it on every rank that came, with a
    ParamsyncError (DEADLINE_EXCEEDED) naming every missing rank, which is torch's
    wait_all_ranks=True report; so wait_all_ranks changes nothing here."""
    g = _member(group, "monitored_barrier")
    if g is None:
        return None
    timeout_ms = None
    if timeout is not None:
        timeout_ms = _ms(timeout)
        if not 0 < timeout_ms <= 0xFFFFFFFF:
            raise ValueError("monitored_barrier: timeout must be positive")
    return _start(g, "monitored_barrier", _K.BARRIER, timeout_ms=timeout_ms)

