"""The shared-memory path: payloads of local workers go through a POSIX segment the agent maps.

Over gRPC every payload byte is framed, copied into the transport and out of
it on both sides. When the agent runs on this host (the one the worker
joined through) the worker instead copies its input into a segment the agent
has mapped, sends only the header, and copies its output back when the
result frame says it is there. The rules are client/shm.c's, so a Python
rank behaves like a C one: the segment is offered once per size with
Worker.ShmAttach, which checks that the agent really maps the same memory
(magic bytes); if it cannot, the process group stays on gRPC for good.

Whatever the agent's address (a node's agent is often reached at the node's
own IP), the segment is offered once: an agent on another host cannot open
it, or sees other magic bytes, and says so. PARAMSYNC_SHM=0 turns the path
off; payloads under MIN_BYTES always go as frames, where one gRPC message is
cheaper than two copies.

Nothing here looks at elements: bytes in, bytes out.
"""
import collections
import ctypes
import errno
import mmap
import os
import platform
import secrets
import struct
import sys
import threading

MIN_BYTES = 64 << 10
ALIGN = 4096

# multiprocessing.shared_memory.SharedMemory would register every name with
# the resource tracker (before Python 3.13 there is no opting out), which
# starts a tracker process, warns about "leaked" segments at exit and unlinks
# names on its own schedule; the agent unlinks ours as soon as it maps them,
# so the tracker would only get in the way. CPython's _posixshmem is the
# module SharedMemory itself calls: shm_open(3) and shm_unlink(3) with the
# C client's name semantics. Without it (another interpreter), /dev/shm is
# where glibc's shm_open puts names on Linux, so opening "/dev/shm" + name
# gives the same object.
try:
    import _posixshmem

    def _shm_open(name, flags, mode):
        return _posixshmem.shm_open(name, flags, mode)

    def _shm_unlink(name):
        _posixshmem.shm_unlink(name)
except ImportError:  # pragma: no cover - CPython on Linux always has it
    _posixshmem = None

    def _shm_open(name, flags, mode):
        if not os.path.isdir("/dev/shm"):
            raise OSError(errno.ENOSYS, "no POSIX shared memory here")
        return os.open("/dev/shm" + name, flags, mode)

    def _shm_unlink(name):
        os.unlink("/dev/shm" + name)


def enabled():
    """PARAMSYNC_SHM=0 turns the path off; read on every collective, as the C client does."""
    return os.environ.get("PARAMSYNC_SHM") != "0"


def layout(in_place, in_bytes, out_bytes):
    """(output offset, segment bytes needed) for one collective. all_reduce and reduce
    write each output step over the input step it was reduced from, so their output
    is at offset 0 and the segment holds the tensor once; other kinds put the output
    after the input, aligned to a page."""
    if in_place:
        return 0, max(in_bytes, out_bytes)
    out_off = (in_bytes + ALIGN - 1) // ALIGN * ALIGN
    return out_off, out_off + out_bytes


class AttachRefused(Exception):
    """The agent cannot use our segments: stay on gRPC for good."""


_counter = 0
_counter_lock = threading.Lock()


class Segment:
    """One process group's segment (the agent keeps one per job rank), used by one
    collective at a time. Every method is thread-safe; none raises for what only
    means "use gRPC frames this time"."""

    def __init__(self, attach):
        # attach(name, size, magic) -> the ShmAttachResponse when the agent mapped it;
        # raises AttachRefused when it never will, anything else for this time only.
        self._attach = attach
        self._lock = threading.Lock()
        self.name = None
        self.map = None
        self.size = 0
        self.in_use = False
        self.disabled = False
        self.closed = False
        self.refused = ""  # why the agent refused our segments, once it has
        self.slots = 1  # payload slots the agent keeps for the rank (ShmAttachResponse)

    def begin(self, in_place, in_bytes, out_bytes, rung=False):
        """Claims the segment for one collective, grown to fit. Returns the output offset,
        or None: this collective takes gRPC frames (too small for a call, in use, refused).
        rung: the doorbell carries it (no call), so any size goes."""
        if (not rung and in_bytes + out_bytes < MIN_BYTES) or not enabled():
            return None
        out_off, need = layout(in_place, in_bytes, out_bytes)
        with self._lock:
            if self.disabled or self.closed or self.in_use:
                return None
            self.in_use = True
        if self.size < need:
            # Grow by doubling so a training loop settles on one segment.
            size = self.size or ALIGN
            while size < need:
                size *= 2
            self._unmap()
            try:
                self._create(size)
            except AttachRefused as e:
                with self._lock:
                    self.disabled = True
                    self.refused = str(e)
                    self.in_use = False
                return None
            except Exception:  # noqa: B902 - any other failure: gRPC this time, retry later
                self.end()
                return None
            except BaseException:
                self.end()
                raise
        return out_off

    def put(self, mvs):
        """Copies the input (uint8 memoryviews, laid end to end) to offset 0."""
        pos = 0
        with memoryview(self.map) as seg:
            for mv in mvs:
                seg[pos:pos + len(mv)] = mv
                pos += len(mv)

    def get(self, offset, nbytes, recv):
        """Copies nbytes at offset into recv (a _tensor.Segments)."""
        with memoryview(self.map) as seg:
            recv.write(0, seg[offset:offset + nbytes])

    def end(self, discard=False):
        """Ends the collective's use, once its call is over: the agent answers only when
        it has let go of the segment. With discard (the call was abandoned before its
        status, so the agent may still read the segment) the next collective makes a
        new one; the agent keeps the old memory for as long as it uses it."""
        if discard:
            self._unmap()
        with self._lock:
            self.in_use = False
            closing = self.closed
        if closing:
            self._unmap()

    def close(self):
        """Unmaps the segment (destroy_process_group); a collective still using it
        unmaps it when it ends."""
        with self._lock:
            self.closed = True
            busy = self.in_use
        if not busy:
            self._unmap()

    def _unmap(self):
        m, self.map, self.size, self.name = self.map, None, 0, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it
                pass

    def _create(self, size):
        """Creates a segment of size bytes and offers it to the agent; sets self.map on
        success."""
        got = []
        self.name, self.map = create(size, lambda *a: got.append(self._attach(*a)))
        self.size = size
        self.slots = max(1, getattr(got[0], "payload_slots", 0) if got else 0)


class Payloads:
    """The rank's payload segment, and spares for collectives in flight beside the one
    using it (async ones), so that those too go through shared memory, not gRPC frames.
    Each is a payload segment in a slot of its own at the agent (ShmAttachRequest.slot:
    the first in slot 0, spare i in slot i + 1), so one that grows replaces only itself.
    Made on demand, as many as the agent keeps slots (ShmAttachResponse.payload_slots, as
    the first's attach said; none with an agent that does not say), at most SPARES."""

    SPARES = 3

    def __init__(self, attach):
        # attach(name, size, magic, slot) -> the ShmAttachResponse (see Segment).
        self._attach = attach
        self.first = Segment(lambda name, size, magic: attach(name, size, magic, 0))
        self._lock = threading.Lock()
        self.spares = []

    @property
    def size(self):
        return self.first.size

    def begin(self, in_place, in_bytes, out_bytes, rung=False):
        """Claims a segment for one collective, grown to fit: (segment, output offset),
        or None: gRPC frames. The caller calls the segment's end()."""
        off = self.first.begin(in_place, in_bytes, out_bytes, rung)
        if off is not None:
            return self.first, off
        if not self.first.in_use or self.first.disabled:
            return None  # too small for a call, refused, closed: frames
        for seg in sorted(list(self.spares), key=lambda x: -x.size):
            off = seg.begin(in_place, in_bytes, out_bytes, rung)
            if off is not None:
                return seg, off
        with self._lock:
            if len(self.spares) >= min(self.SPARES, self.first.slots - 1) or self.first.closed:
                return None
            slot = len(self.spares) + 1
            seg = Segment(lambda name, size, magic: self._attach(name, size, magic, slot))
            self.spares.append(seg)
        off = seg.begin(in_place, in_bytes, out_bytes, rung)
        return None if off is None else (seg, off)

    def close(self):
        with self._lock:
            segs = [self.first] + self.spares
        for seg in segs:
            seg.close()


def create(size, attach, pass_map=False, keep_fd=None):
    """Creates a segment of size bytes and offers it to the agent with attach(name, size,
    magic) (pass_map: attach(name, size, magic, mmap)); returns (name, mmap). The name
    never outlives this function, whatever happens. keep_fd, a list: the segment's file
    stays open, its descriptor appended there (closed on failure)."""
    global _counter
    with _counter_lock:
        _counter += 1
        n = _counter
    name = "/paramsync.%d.%d.%x" % (os.getpid(), n, secrets.randbits(24))
    try:
        fd = _shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        # No usable /dev/shm here: it will not appear later (client/shm.c).
        raise AttachRefused("shm_open %s: %s" % (name, e.strerror)) from None
    m = None
    try:
        try:
            os.ftruncate(fd, size)
            # tmpfs hands out pages on first touch: a full /dev/shm would
            # then kill this process with SIGBUS in the middle of a copy.
            # Reserving them now turns that into an error, and gRPC frames.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if keep_fd is None or m is None:
                os.close(fd)
                fd = -1
        # Random, in native byte order: the agent memcpy's 8 bytes into a uint64.
        magic = secrets.randbits(64)
        m[0:8] = magic.to_bytes(8, sys.byteorder)
        if pass_map:
            attach(name, size, magic, m)
        else:
            attach(name, size, magic)
        m[0:8] = bytes(8)  # checked: the memory reads as zeros again
    except BaseException:
        if m is not None:
            m.close()
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        # The agent unlinks the name once it maps the segment; do it here
        # too for every other outcome, so nothing is left in /dev/shm.
        try:
            _shm_unlink(name)
        except OSError:
            pass
    if keep_fd is not None:
        keep_fd.append(fd)
    return name, m


def address(buf):
    """The address of a buffer's first byte (numpy reads it for any buffer, even read-only)."""
    import numpy as np
    return int(np.frombuffer(buf, np.uint8).ctypes.data) if len(buf) else 0


def addresses(x):
    """The addresses of the buffers of x (a _tensor.Segments), worked out once per
    collective however many of own_in_place and placed ask."""
    if x.addrs is None:
        x.addrs = [address(mv) for mv in x.mvs]
    return x.addrs


def end_to_end(at, mvs):
    """Whether buffers mvs, at addresses at, lie end to end in memory (the chunks of one
    tensor, in order): one buffer to the agent."""
    return all(a + len(mv) == b for a, mv, b in zip(at, mvs, at[1:]))


def own_in_place(scatters, rank, send, recv):
    """Whether a collective is in place in torch's form (one buffer each way, or its
    chunks): an all_gather's or gather root's input is its own block of the output, or
    (scatters) a scatter root's output its block of the input. Agents that say so at
    attach (ShmAttachResponse.own_block) take it in place (header.own_block)."""
    if send is None or recv is None or not send.total or not recv.total:
        return False
    ends = []
    for x in (send, recv):
        at = addresses(x)
        if not end_to_end(at, x.mvs):
            return False
        ends.append(at[0])
    a_in, a_out = ends
    if scatters:
        return a_out == a_in + rank * recv.total
    return a_in == a_out + rank * send.total


def placed(in_place, send, recv, own=False, lists=False):
    """Where a collective's input and output lie when the agent may use them in place:
    one contiguous buffer each way (or none), apart, or all_reduce/reduce's one buffer,
    or (own: own_in_place) the rank's own block in place; buffers laid end to end (the
    chunks of one tensor) count as one; with lists, a side may also be several buffers
    of one size (a list form: header.shm_in_blocks, shm_out_blocks), no two of them
    overlapping.
    ((input bytes, address), (output bytes, address)), each None when there are no such
    bytes, the address a list of addresses for a side of several buffers; or None when
    they do not lie so."""
    ends, spans = [], []
    for x in (send, recv):
        mvs = x.mvs if x is not None and x.total else []
        at = addresses(x) if mvs else []
        spans += [(a, len(mv)) for a, mv in zip(at, mvs)]
        if end_to_end(at, mvs):
            at = at[:1]
        elif not lists or any(len(mv) != len(mvs[0]) for mv in mvs):
            return None
        ends.append(None if not mvs else (x.total, at if len(at) > 1 else at[0]))
    i, o = ends
    if own or (in_place and i is not None and o is not None and i[1] == o[1]):
        return i, o
    spans.sort()
    if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
        return None
    return i, o


DIRECT_MIN = 32 << 20  # input and output bytes together, on small pages: client/shm.c
DIRECT_HUGE_MIN = 8 << 20  # bytes of buffers (overlaps once) where collapse() gives huge pages


def direct_enabled():
    """PARAMSYNC_SHM_DIRECT=0 turns the process segment off; read per collective."""
    return enabled() and os.environ.get("PARAMSYNC_SHM_DIRECT") != "0"


_HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux 6.1
_collapse_seen = collections.deque(maxlen=64)  # ranges taken directly before
_collapse_failed = collections.deque(maxlen=16)  # ranges the kernel would not collapse
_collapse_eagain = collections.deque(maxlen=16)  # ranges refused once with EAGAIN, for now
_collapse_lock = threading.Lock()
_madvise = []  # libc's madvise, once looked up
_collapse_works = []  # whether the kernel collapses on request, once probed


def _collapse_off():
    """PARAMSYNC_SHM_COLLAPSE=0: no collapse(), and direct_min() as on small pages."""
    return os.environ.get("PARAMSYNC_SHM_COLLAPSE") == "0"


def _libc_madvise():
    """libc's madvise, looked up once (call with _collapse_lock held)."""
    if not _madvise:
        f = ctypes.CDLL(None, use_errno=True).madvise
        f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        f.restype = ctypes.c_int
        _madvise.append(f)
    return _madvise[0]


def _collapse_probe():
    """client/shm.c's collapse_probe(): whether this kernel collapses memory on request
    (MADV_COLLAPSE, Linux 6.1; THP not "never"), tried on a scratch mapping."""
    m = mmap.mmap(-1, 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    try:
        base = ctypes.addressof(anchor)
        at = (base + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        m[at - base:at - base + _HUGE_PAGE] = b"\1" * _HUGE_PAGE
        return _libc_madvise()(at, _HUGE_PAGE, _MADV_COLLAPSE) == 0
    finally:
        del anchor
        m.close()


def direct_min():
    """client/shm.c's direct_min(): the fewest bytes of buffers a request takes directly,
    8 MiB where collapse() can give huge pages (probed once), else 32 MiB (and with
    PARAMSYNC_SHM_COLLAPSE=0)."""
    if _collapse_off():
        return DIRECT_MIN
    with _collapse_lock:
        if not _collapse_works:
            _collapse_works.append(_collapse_probe())
        return DIRECT_HUGE_MIN if _collapse_works[0] else DIRECT_MIN


def collapse(addr, nbytes):
    """client/shm.c's collapse(): when the agent takes a buffer directly for the second
    time (not for a buffer used once), asks the kernel for huge pages under its whole
    2 MiB pages (madvise MADV_COLLAPSE; the contents stay), which process_vm_readv/writev
    pin far faster. That costs a copy once (what could not be taken just then, one
    EAGAIN, is asked again next time); a range the kernel would not collapse is not asked
    again while among the last 16 such. PARAMSYNC_SHM_COLLAPSE=0 turns it off."""
    at = (addr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (addr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= at or _collapse_off():
        return
    with _collapse_lock:
        again = (at, end) in _collapse_seen
        if not again:
            _collapse_seen.append((at, end))
        if not again or (at, end) in _collapse_failed:
            return
        madvise = _libc_madvise()
    if madvise(at, end - at, _MADV_COLLAPSE) == 0:
        return
    # EAGAIN: some pages could not be taken just then; the next call asks again, but a
    # second EAGAIN for the range (pages pinned for good) counts as a refusal.
    now = ctypes.get_errno() == errno.EAGAIN
    with _collapse_lock:
        if now and (at, end) not in _collapse_eagain:
            _collapse_eagain.append((at, end))
        else:
            _collapse_failed.append((at, end))


class Process:
    """The rank's process segment (Worker.ShmAttach process=true; client/shm.c): once the
    agent checked that it may, it reads a large doorbell request's input from this
    process's own buffer and writes the output into the caller's (header.shm_process),
    so nothing is copied through a payload segment. Made on first use; refused (another
    PID namespace, ptrace rules, an older agent) it stays off. Any number of collectives
    use it at once: it only names this process."""

    def __init__(self, attach):
        self._attach = attach  # attach(name, size, magic, address): raises when refused
        self._lock = threading.Lock()
        self.name = None
        self.map = None
        self.disabled = False
        self.making = False
        self.refused = ""  # why it stays off, once it does
        self.used = 0  # collectives that went this way
        self.own_block = False  # the agent takes the own block in place (own_in_place)
        self.block_lists = False  # the agent takes list forms (header.shm_in_blocks)

    def begin(self, in_place, send, recv, own=False):
        """(input address, output address) of a collective large enough, whose input and
        output are one buffer each, apart (or all_reduce/reduce's one buffer, or with own
        the rank's own block in place, when the agent takes that), each address a list
        for a side of several buffers of one size (when the agent takes lists); None: use
        the segments."""
        if not direct_enabled():
            return None
        got = placed(in_place, send, recv, own, lists=True)
        if got is None:
            return None
        a_in, a_out = (e[1] if e is not None else 0 for e in got)
        sizes, least = [e[0] for e in got if e is not None], direct_min()
        # On huge pages bytes of buffers, counted once where input and output overlap; on
        # small pages, as measured when that floor was set, input and output together.
        once = least == DIRECT_HUGE_MIN and (own or (in_place and a_in == a_out))
        if (max(sizes, default=0) if once else sum(sizes)) < least:
            return None
        listed = isinstance(a_in, list) or isinstance(a_out, list)
        with self._lock:
            if self.disabled or self.making:
                return None
            make = self.map is None
            self.making = make
        if make:
            resp = []
            try:
                self.name, self.map = create(
                    ALIGN, lambda n, s, magic, m: resp.append(
                        self._attach(n, s, magic, address(m))), pass_map=True)
                self.own_block = bool(getattr(resp[0], "own_block", False))
                self.block_lists = bool(getattr(resp[0], "block_lists", False))
            except Exception as e:  # noqa: B902 - refused or failed: segments, for good
                with self._lock:
                    self.disabled = True
                    self.refused = str(e)
            finally:
                with self._lock:
                    self.making = False
            if self.map is None:
                return None
        if (own and not self.own_block) or (listed and not self.block_lists):
            return None
        ranges = set()  # all_reduce's one buffer once
        for e in got:
            if e is not None:
                ats = e[1] if isinstance(e[1], list) else [e[1]]
                ranges.update((a, e[0] // len(ats)) for a in ats)
        for a, nbytes in ranges:
            collapse(a, nbytes)
        with self._lock:
            self.used += 1
        return a_in, a_out

    def close(self):
        with self._lock:
            self.disabled = True
            m, self.map = self.map, None
        if m is not None:
            m.close()


class Mem:
    """One allocation of Registered: its segment (name None: plain memory, the agent
    could not share it), where it is mapped here, and whether a collective uses it."""
    __slots__ = ("name", "map", "addr", "size", "in_use", "retired", "own_block", "resident",
                 "fd", "two")

    def __init__(self, name, m, size, own_block=False, resident=None, fd=-1, two=False):
        self.name = name
        # The segment's file, kept open (FD_MIN_BYTES and up) for the ranks that copy from
        # it rank to rank to map (_peer.Maps); -1: none.
        self.fd = fd
        self.map = m
        self.size = size
        self.addr = address(m)
        self.in_use = False
        self.retired = False  # a call was abandoned: the agent may still write into it
        self.own_block = own_block  # the agent takes the own block in place (own_in_place)
        # The agent's --shm-resident-bytes (ShmAttachResponse.resident_bytes; None: not
        # told): a collective touching more of its ranks' memory goes through the files.
        self.resident = resident
        # The agent takes a collective's output in another allocation than its input
        # (ShmAttachResponse.two_segments, CollectiveHeader.shm_out).
        self.two = two

    def holds(self, addr, nbytes):
        return self.addr <= addr and addr + nbytes <= self.addr + self.size

    def mapped_for(self, touched):
        """Whether the agent takes a collective touching `touched` bytes of its ranks'
        memory (summed over them) in place, through its mapping of this allocation (the
        budget of the C client's ps__mem_in_place): never plain memory."""
        return self.name is not None and (self.resident is None or touched <= self.resident)

    def close_fd(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Allocations of empty() this large keep their segment's file open (client/shm.c's
# PS__MEM_FD_MIN_BYTES): smaller ones are not worth mapping, and many would use up
# descriptors.
FD_MIN_BYTES = 1 << 20


class Registered:
    """Memory from distributed.empty(), the C client's ps_mem_alloc: each allocation a
    segment of its own that the agent keeps (Worker.ShmAttach registered=true, at most 64
    per rank) and reads and writes in place, so a collective whose input and output lie
    in one allocation copies nothing here. One collective at a time per allocation; a
    concurrent one copies, as do collectives on any other memory."""

    def __init__(self, attach, detach):
        self._attach = attach  # attach(name, size, magic), as a registered segment
        self._detach = detach  # detach(name), best effort
        self._lock = threading.Lock()
        self.mems = []

    def alloc(self, nbytes):
        """A Mem of at least nbytes (rounded up to a page); plain memory when the agent
        cannot share it."""
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        mem = None
        if enabled():
            try:
                resp, fd = [], []
                name, m = create(size, lambda *a: resp.append(self._attach(*a)),
                                 keep_fd=fd if size >= FD_MIN_BYTES else None)
                told = getattr(resp[0], "resident_told", False)
                mem = Mem(name, m, size, bool(getattr(resp[0], "own_block", False)),
                          resp[0].resident_bytes if told else None, fd[0] if fd else -1,
                          bool(getattr(resp[0], "two_segments", False)))
            except Exception:  # noqa: B902 - refused or failed: plain memory, as in C
                mem = None
        if mem is None:
            mem = Mem(None, mmap.mmap(-1, size), size)
        with self._lock:
            self.mems.append(mem)
        return mem

    def find(self, addr, nbytes=1):
        """The allocation holding [addr, addr + nbytes), or None."""
        with self._lock:
            for mem in self.mems:
                if mem.addr <= addr and addr + nbytes <= mem.addr + mem.size:
                    return mem
        return None

    def in_place(self, send, recv, touched):
        """Whether one shared allocation holds every buffer of send and recv (Segments, or
        None) and the agent takes a collective touching `touched` bytes of its ranks'
        memory in place there (Mem.mapped_for), as the C client's ps__mem_in_place: from
        two allocations the agent takes it in place too (begin: header.shm_out), but peer
        copies measured about as fast there and spare the agent's CPU, so not asked."""
        spans = [(a, len(mv)) for x in (send, recv) if x is not None
                 for a, mv in zip(addresses(x), x.mvs)]
        if not spans:
            return False
        mem = self.find(*spans[0])
        return mem is not None and mem.mapped_for(touched) and all(
            mem.addr <= a and a + n <= mem.addr + mem.size for a, n in spans)

    def file_of(self, addr, nbytes):
        """(start, bytes, file descriptor) of the shared allocation holding [addr, addr +
        nbytes) whole whose file is kept open, or None."""
        with self._lock:
            for mem in self.mems:
                if (mem.name is not None and mem.fd >= 0 and mem.addr <= addr
                        and addr + nbytes <= mem.addr + mem.size):
                    return mem.addr, mem.size, mem.fd
        return None

    def free(self, addr):
        """Forgets the allocation starting at addr and tells the agent. False when there is
        none, or a collective still uses it. The memory itself stays valid for as long as
        arrays on it live."""
        with self._lock:
            mem = next((x for x in self.mems if x.addr == addr), None)
            if mem is None or mem.in_use:
                return False
            self.mems.remove(mem)
            mem.close_fd()
        if mem.name is not None:
            try:
                self._detach(mem.name)
            except Exception:  # noqa: B902 - the agent drops it when the rank leaves anyway
                pass
        return True

    def _free_holding(self, addr, nbytes):
        """The shared allocation holding [addr, addr + nbytes) that no collective uses,
        or None. Lock held."""
        return next((x for x in self.mems if x.name is not None and not x.in_use and
                     not x.retired and x.holds(addr, nbytes)), None)

    def begin(self, in_place, send, recv, own=False):
        """Claims the allocation that holds this collective's input and output (one
        contiguous buffer each, apart, or all_reduce/reduce's one buffer, or with own the
        rank's own block in place, where the agent takes that), or (not own) the input's
        and the output's allocations where the agent takes two (header.shm_out), as
        tensors of two empty() calls, when there are such. Returns (mems: one allocation,
        or the input's and the output's, input offset, output offset), or None."""
        if not self.mems or not enabled():
            return None
        got = placed(in_place, send, recv, own)
        if got is None or got == (None, None):
            return None
        (ins, a_in), (outs, a_out) = (e if e is not None else (0, None) for e in got)
        spans = [(a, n) for a, n in ((a_in, ins), (a_out, outs)) if a is not None]
        with self._lock:
            mems = [self._free_holding(*spans[0])]
            if mems[0] is not None and len(spans) > 1 and not mems[0].holds(*spans[1]):
                mems.append(None if own else self._free_holding(*spans[1]))
                if mems[1] is not None and not (mems[0].two and mems[1].two):
                    mems[1] = None
            if None in mems or (own and not mems[0].own_block):
                return None
            for mem in mems:
                mem.in_use = True
        return (tuple(mems), a_in - mems[0].addr if a_in is not None else 0,
                a_out - mems[-1].addr if a_out is not None else 0)

    def end(self, mems, discard=False):
        """Releases what begin claimed."""
        with self._lock:
            for mem in mems:
                mem.in_use = False
                mem.retired |= discard

    def close(self):
        """Forgets every allocation (the rank left: the agent dropped them). Arrays on them
        keep their memory."""
        with self._lock:
            for mem in self.mems:
                mem.close_fd()
            self.mems = []


# -- the doorbell (proto/paramsync/v1/doorbell.h: the layout is part of the wire contract)

DB_SIZE = 8192
DB_PAYLOAD = 2048  # the most input, and the most output, bytes
DB_OUT = 2048  # offset of the output
DB_CTL = 4096  # offset of ps_doorbell_ctl_t
DB_HEADER = 1024  # the largest packed header
_REQ, _RESP, _CLOSED, _HLEN, _HDR = DB_CTL, DB_CTL + 4, DB_CTL + 8, DB_CTL + 12, DB_CTL + 16
_CODE = DB_CTL + 16 + DB_HEADER  # then source, shm (int32, int32, uint32)
_MSG = DB_CTL + 28 + DB_HEADER
_MSG_LEN = 2048
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
DB_STOPPED = 2  # a bit of the closed word: the agent's thread for it has ended
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    """libc's syscall(2), or None where this module does not know SYS_futex."""
    if _SYS_FUTEX is None:
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_long
    return f


class Words:
    """The 32-bit words of a shared mapping, read in place and waited on and woken as
    futexes between processes (never FUTEX_PRIVATE_FLAG): a doorbell's, a barrier
    page's (_barrier). Needs _syscall()."""

    def __init__(self, m):
        self.map = m
        self._anchor = ctypes.c_char.from_buffer(m)  # keeps the address valid for futexes
        self._addr = ctypes.addressof(self._anchor)
        self._syscall = _syscall()

    def u32(self, off):
        return struct.unpack_from("=I", self.map, off)[0]

    def futex(self, off, op, val, timeout_s=None):
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1) * 1e9)))
        return self._syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr + off), op, val, ts,
                             None, 0)

    def close(self):
        """Unmaps it (left to the GC while a view of it is alive somewhere)."""
        self._anchor = None
        try:
            self.map.close()
        except BufferError:
            pass


class Doorbell:
    """Collectives without a gRPC call, as the C client does: when the agent is on this
    host, a collective goes as the packed header in a small segment, a futex wake, and a
    futex wait for the answer. Input and output that each fit in DB_PAYLOAD bytes go in the
    doorbell; larger ones in the payload segment or empty() memory, whatever their size,
    when the agent takes such requests (`segments`: ShmAttachResponse.doorbell_segments).
    One request at a time (Doorbells gives collectives in flight side by side one each). A
    request abandoned (the job broke while it waited) retires the doorbell, since the agent
    may still answer into it.

    Stores to the segment are ordered by a lock's acquire and release around the request
    and answer words (a full barrier in CPython's locks), so this holds beyond x86's
    ordering too."""

    def __init__(self, attach):
        # attach(name, size, magic), as a doorbell segment: the ShmAttachResponse.
        self._attach = attach
        self.segments = False  # the agent takes requests naming the rank's other segments
        self.most = 1  # the most doorbells the agent keeps for the rank
        self._lock = threading.Lock()
        self._fence = threading.Lock()
        self.map = None
        self.words = None  # Words of map
        self.name = None
        self.in_use = False
        self.disabled = _syscall() is None
        self.rung = 0  # requests answered through the doorbell (tests read it)

    def _attach_doorbell(self, name, size, magic):
        resp = self._attach(name, size, magic)
        self.segments = bool(resp.doorbell_segments)
        self.most = max(1, resp.doorbells)

    def begin(self, claimed=False):
        """Claims the doorbell (making it on first use); False: use a call. claimed: the
        caller set in_use already (a doorbell just made for it)."""
        if not claimed:
            if not enabled():
                return False
            with self._lock:
                if self.disabled or self.in_use:
                    return False
                self.in_use = True
        if self.map is None:
            try:
                self.name, self.map = create(DB_SIZE, self._attach_doorbell)
            except Exception:  # noqa: B902 - refused (not the hub, another host) or failed
                with self._lock:
                    self.disabled = True
                    self.in_use = False
                return False
            self.words = Words(self.map)
        if self.words.u32(_CLOSED):
            with self._lock:
                self.disabled = True
                self.in_use = False
            return False
        return True

    def run(self, header, mvs, broken, direct=False):
        """Rings for one collective whose header names this segment (the caller sets
        header.shm and shm_out_offset = DB_OUT), with its input mvs, or another segment of
        the rank's with the input in it already (mvs empty). Waits for the answer,
        checking broken() (None, or the exception that ends the wait) between short
        waits. direct: the agent reads and writes the caller's own buffers
        (header.shm_process), so the wait ends unanswered only once the agent can write
        no more: broken() should then say only that the agent is gone, and a closed
        doorbell counts once its thread stopped (DB_STOPPED). Returns (code, message,
        source, output memoryview or None), or None when the header does not fit (then
        use a call). The caller calls end()."""
        packed = header.SerializeToString()
        if len(packed) > DB_HEADER:
            return None
        m = self.map
        pos = 0
        for mv in mvs:
            m[pos:pos + len(mv)] = mv
            pos += len(mv)
        m[_HDR:_HDR + len(packed)] = packed
        struct.pack_into("=I", m, _HLEN, len(packed))
        w = self.words
        req = (w.u32(_REQ) + 1) & 0xFFFFFFFF
        with self._fence:  # everything above is visible before req
            pass
        struct.pack_into("=I", m, _REQ, req)
        w.futex(_REQ, _FUTEX_WAKE, 1)
        while True:
            r = w.u32(_RESP)
            if r == req:
                break
            # Short waits: a job that breaks meanwhile is noticed on the next turn.
            w.futex(_RESP, _FUTEX_WAIT, r, 0.05)
            if w.u32(_RESP) == req:
                break
            err = broken()
            closed = w.u32(_CLOSED) & (DB_STOPPED if direct else 0xFFFFFFFF)
            if err is not None or closed:
                with self._lock:
                    self.disabled = True  # abandoned: the agent may still answer into it
                if err is None:
                    err = ConnectionError("the agent closed the doorbell (it is stopping)")
                raise err
        with self._fence:  # the answer is read after resp
            pass
        code, source, shm = struct.unpack_from("=iiI", m, _CODE)
        msg = bytes(m[_MSG:_MSG + _MSG_LEN]).split(b"\0", 1)[0].decode("utf-8", "replace")
        self.rung += 1
        return code, msg, source, (memoryview(m)[DB_OUT:DB_OUT + DB_PAYLOAD] if shm else None)

    def end(self):
        with self._lock:
            self.in_use = False

    def close(self):
        """No more requests (destroy_process_group); unmaps unless one is under way."""
        with self._lock:
            self.disabled = True
            busy = self.in_use
        if not busy and self.words is not None:
            self.words.close()


class Doorbells:
    """A rank's doorbells: a free one for each collective, so that collectives in flight
    side by side (async ones) each ring their own. Made on demand, up to as many as the
    agent keeps for a rank (ShmAttachResponse.doorbells; one for an agent that does not
    say, and never more than MAX); past that a collective takes a call."""

    MAX = 8

    def __init__(self, attach):
        self._attach = attach  # attach(name, size, magic), as a doorbell segment
        self._lock = threading.Lock()
        self.all = []
        self._max = 1  # until the first doorbell's answer says

    @property
    def rung(self):
        """Requests answered through the doorbells (tests read it)."""
        return sum(d.rung for d in list(self.all))

    def begin(self):
        """Claims a doorbell (making one when all are busy and the agent takes more), or
        returns None: use a call. The caller calls its end()."""
        if not enabled():
            return None
        for d in list(self.all):
            if d.begin():
                return d
        with self._lock:
            if len(self.all) >= self._max:
                return None
            d = Doorbell(self._attach)
            d.in_use = True  # this caller's: no other claims it while it is made
            self.all.append(d)
        if d.begin(claimed=True):
            with self._lock:
                if d is self.all[0]:
                    self._max = min(d.most, self.MAX)
            return d
        with self._lock:
            self._max = len(self.all)  # refused or failed: no more are made
        return None

    def close(self):
        for d in list(self.all):
            d.close()
