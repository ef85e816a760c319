"""Peer copies: large all_to_all, all_gather, gather and scatter calls whose ranks all
share one agent copy each block once, rank to rank, with process_vm_readv (the C client's
client/peer.c, whose rules and descriptor layout these are, so C and Python ranks take part
together).

Through the agent a block costs two copies, both on the agent's threads. Here each rank
reads its blocks straight from the other ranks' inputs into its output: an all_gather of
each rank's descriptor (seq s), the reads, then an all_reduce (MAX) of each rank's outcome
(seq s + 1), so that no rank returns, and so none touches its input, before every rank has
read. Where any rank could not read, every rank learns it from the all_reduce and the call
goes through the agent with seq s + 2 (s + 1 when the descriptors already showed it could
not be done). Whether a call takes the path at all is decided alike on every rank before it
takes a sequence number, from JoinEvent.peer_sets: same agent, same PID namespace, both
asked at Join (PARAMSYNC_PEER_COPY=0 or PARAMSYNC_SHM=0 keep a rank out).
"""
import ctypes
import os
import stat
import struct
import threading

from . import _shm
from ._proto import pb

# The fewest bytes of all blocks together that take the path, by kind, as client/peer.c.
ALL_GATHER, GATHER, SCATTER, ALL_TO_ALL = (pb.CollectiveKind.ALL_GATHER, pb.CollectiveKind.GATHER,
                                           pb.CollectiveKind.SCATTER,
                                           pb.CollectiveKind.ALL_TO_ALL)
MIN_BYTES = {ALL_TO_ALL: 2 << 20, ALL_GATHER: 4 << 20, GATHER: 8 << 20, SCATTER: 4 << 20}
MAX_ALL_TO_ALL_RANKS = 64  # all_to_all and scatter: descriptors of n words each
MAGIC = 0x3270656572737370
# Words 6 to 15 describe a C rank's CUDA device input (device peer copies): 0 here, where
# inputs are host memory; a rank whose input is device memory sets bit 33 of W_PID_FITS,
# and a call whose ranks differ in it goes through the agent.
W_MAGIC, W_PIDNS_DEV, W_PIDNS_INO, W_NONCE_ADDR, W_NONCE, W_PID_FITS = range(6)
W_BLOCKS = 16
FITS_HOST, FITS_DEVICE = 1 << 32, 1 << 33
# With bit 34 a rank's input lies in an empty() segment whose file it keeps open: words 6,
# 7 and 8 are where the segment starts in that process, its bytes, and the file's number
# there; readers map it (Maps) instead of reading with process_vm_readv, which pins shared
# pages one by one (client/peer.c).
FITS_SEGMENT = 1 << 34
W_SEG_BASE, W_SEG_SIZE, W_SEG_FD = 6, 7, 8
SEQS = 3  # sequence numbers a call that takes this path holds


class Self:
    """This process to its peers, read once: its PID namespace, and a random number at a
    fixed address that peers read, in the same system call as a block, to know they read
    this process."""

    def __init__(self):
        try:
            st = os.stat("/proc/self/ns/pid")
            self.pidns_dev, self.pidns_ino = st.st_dev, st.st_ino
        except OSError:
            self.pidns_dev = self.pidns_ino = 0
        self.nonce = int.from_bytes(os.urandom(8), "little")
        self._cell = ctypes.c_uint64(self.nonce)
        self.nonce_address = ctypes.addressof(self._cell)


def wanted(me):
    """Whether to ask for peer copies at Join (JoinRequest.peer_copies, with me.pidns_ino
    as pid_namespace): not with PARAMSYNC_PEER_COPY=0 or PARAMSYNC_SHM=0, nor under Yama
    ptrace_scope 1 or more (a process may then read only its descendants)."""
    if os.environ.get("PARAMSYNC_PEER_COPY") == "0" or not _shm.enabled() or not me.pidns_ino:
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().split()[0])
    except FileNotFoundError:
        scope = 0
    except (OSError, ValueError, IndexError):
        scope = 1
    return scope == 0


def blocks_per_rank(kind):
    """Whether each rank's input holds a block for every rank (all_to_all, a scatter's
    root) rather than one (all_gather, gather)."""
    return kind in (ALL_TO_ALL, SCATTER)


def takes(kind, block, sets, group_ranks, rank):
    """Whether a call takes peer copies: its blocks (of `block` bytes, one per rank of
    its group) are enough bytes, and every rank of the group (job ranks group_ranks) is
    in this rank's (job rank `rank`) peer-copy set."""
    n = len(group_ranks)
    if kind not in MIN_BYTES or not sets or n < 2 or block * n < MIN_BYTES[kind]:
        return False
    if blocks_per_rank(kind) and n > MAX_ALL_TO_ALL_RANKS:
        return False
    return one_set(sets, group_ranks, rank)


def one_set(sets, group_ranks, rank):
    """Whether every rank of the group (job ranks group_ranks) is in this rank's (job rank
    `rank`) peer-copy set, so that its calls may go rank to rank."""
    mine = sets[rank] if sets else 0
    return mine != 0 and all(sets[r] == mine for r in group_ranks)


def agent_touches(kind, n, block):
    """The bytes of its ranks' memory an agent taking the call would touch, summed over
    them, as it counts them against --shm-resident-bytes (client/peer.c)."""
    if kind == ALL_TO_ALL:
        return 2 * n * n * block
    if kind == ALL_GATHER:
        return n * block + n * n * block
    return 2 * n * block  # gather, scatter: every rank's block, and the root's n


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = []


def _process_vm_readv():
    if not _readv:
        f = ctypes.CDLL(None, use_errno=True).process_vm_readv
        f.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                      ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong)
        f.restype = ctypes.c_ssize_t
        _readv.append(f)
    return _readv[0]


def block_addresses(segs, addrs, n, block):
    """The address of each of the n blocks of `block` bytes of segs (a _tensor.Segments whose
    buffers are at addrs), or None where a block spans two buffers."""
    out = []
    i = 0
    for j in range(n):
        at = j * block
        while i + 1 < len(segs.starts) and segs.starts[i + 1] <= at:
            i += 1
        off = at - segs.starts[i]
        if off + block > len(segs.mvs[i]):
            return None
        out.append(addrs[i] + off)
    return out


def map_wanted():
    """PARAMSYNC_PEER_MAP=0: read empty() memory with process_vm_readv too (client/peer.c)."""
    return os.environ.get("PARAMSYNC_PEER_MAP") != "0"


def describe(me, ins, fits, seg=None):
    """This rank's descriptor (bytes): me its Self, ins the addresses of its input's blocks
    (an all_to_all's or scatter root's n, an all_gather's or gather's one); fits: its
    buffers suit peer copies; seg: (start, bytes, descriptor) of the empty() segment its
    input lies in whole, kept open, for the others to map."""
    words = [MAGIC, me.pidns_dev, me.pidns_ino, me.nonce_address, me.nonce,
             (os.getpid() & 0xFFFFFFFF) | (FITS_HOST if fits else 0)]
    words += [0] * (W_BLOCKS - len(words))
    if fits and seg is not None:
        words[W_PID_FITS] |= FITS_SEGMENT
        words[W_SEG_BASE:W_SEG_FD + 1] = seg
    words += ins
    return struct.pack("=%dQ" % len(words), *words)


def all_fit(descs, n, words):
    """Whether every rank of the descriptors (bytes of n x words 64-bit words) may be read."""
    d = struct.unpack("=%dQ" % (n * words), descs)
    for i in range(n):
        x = d[i * words:(i + 1) * words]
        if (x[W_MAGIC] != MAGIC or not x[W_PID_FITS] & FITS_HOST
                or x[W_PID_FITS] & FITS_DEVICE or not x[W_PID_FITS] & 0xFFFFFFFF
                or not x[W_PIDNS_INO] or x[W_PIDNS_DEV] != d[W_PIDNS_DEV]
                or x[W_PIDNS_INO] != d[W_PIDNS_INO]):
            return None
    return d


_SYS_PIDFD_GETFD = 438  # the same on every architecture (new system calls share numbers)
_PROT_READ, _MAP_SHARED = 1, 1
_libc = []


def _libc_calls():
    """libc's syscall, mmap and munmap through ctypes."""
    if not _libc:
        lib = ctypes.CDLL(None, use_errno=True)
        sc, mm, mu = lib.syscall, lib.mmap, lib.munmap
        sc.restype = ctypes.c_long
        mm.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
        mm.restype = ctypes.c_void_p
        mu.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        mu.restype = ctypes.c_int
        _libc.append((sc, mm, mu))
    return _libc[0]


def _peer_file(pidfd, fd):
    """The file at number fd of the process pidfd: (a descriptor of it here, its stat), or
    None when it cannot be taken or is not a regular file."""
    syscall = _libc_calls()[0]
    here = syscall(_SYS_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    if here < 0:
        return None
    try:
        st = os.fstat(here)
    except OSError:
        os.close(here)
        return None
    if not stat.S_ISREG(st.st_mode):
        os.close(here)
        return None
    return here, st


class Maps:
    """Other ranks' empty() segments mapped here, as the C client keeps them (its table of
    other ranks' memory, client/peer.c): taken with pidfd_getfd, mapped read-only, kept for
    later calls (at most CAP; the oldest unused one goes), and let go, after each call's
    reads, where the call did not use them and the owner no longer holds that file (freed,
    or gone): a mapping keeps the owner's memory."""
    CAP = 32

    def __init__(self):
        self._lock = threading.Lock()
        self._maps = {}  # (pid, fd there, dev, ino, bytes) -> [address, users, last use]
        self._clock = 0

    def _take(self, key, fd):
        with self._lock:
            e = self._maps.get(key)
            if e is not None:
                e[1] += 1
                self._clock += 1
                e[2] = self._clock
                return e[0], True
        mmap_, munmap = _libc_calls()[1:]
        at = mmap_(None, key[4], _PROT_READ, _MAP_SHARED, fd, 0)
        if at is None or at == ctypes.c_void_p(-1).value:
            return None, False
        with self._lock:
            if key not in self._maps:
                if len(self._maps) >= self.CAP:
                    idle = [k for k, v in self._maps.items() if v[1] == 0]
                    if not idle:
                        return at, False  # for this copy alone
                    old = min(idle, key=lambda k: self._maps[k][2])
                    munmap(self._maps.pop(old)[0], old[4])
                self._clock += 1
                self._maps[key] = [at, 1, self._clock]
                return at, True
        munmap(at, key[4])  # another thread mapped it meanwhile
        return self._take(key, fd)

    def _give(self, key, at, kept):
        if not kept:
            _libc_calls()[2](at, key[4])
            return
        with self._lock:
            self._maps[key][1] -= 1

    def read(self, x, which, to, block, nonce_ok):
        """Copies block `which` of the rank whose descriptor is x (FITS_SEGMENT) to address
        `to` through a mapping of its segment: whether it could. nonce_ok(x) reads the
        rank's nonce, after the pidfd is taken, so a pid used again would not hold it."""
        base, size, at = x[W_SEG_BASE], x[W_SEG_SIZE], x[W_BLOCKS + which]
        if not size or at < base or at - base > size or block > size - (at - base) \
                or x[W_SEG_FD] > 0x7FFFFFFF:
            return False
        pid = x[W_PID_FITS] & 0xFFFFFFFF
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return False
        try:
            got = _peer_file(pidfd, x[W_SEG_FD]) if nonce_ok(x) else None
        finally:
            os.close(pidfd)
        if got is None:
            return False
        fd, st = got
        try:
            # A file shorter than the mapping would fault on the copy (SIGBUS).
            if st.st_size < size:
                return False
            key = (pid, x[W_SEG_FD], st.st_dev, st.st_ino, size)
            m, kept = self._take(key, fd)
        finally:
            os.close(fd)
        if m is None:
            return False
        ctypes.memmove(to, m + (at - base), block)
        self._give(key, m, kept)
        return True

    def clock(self):
        """A mark for sweep: mappings used after it are left alone."""
        with self._lock:
            return self._clock

    def sweep(self, since):
        """Lets go of the idle mappings not used since the mark `since` (those a call just
        used it has checked) whose owner no longer holds that file there."""
        with self._lock:
            keys = [k for k, v in self._maps.items() if v[1] == 0 and v[2] <= since]
        for key in keys:
            held = False
            try:
                pidfd = os.pidfd_open(key[0])
            except OSError:
                pidfd = -1
            if pidfd >= 0:
                got = _peer_file(pidfd, key[1])
                os.close(pidfd)
                if got is not None:
                    os.close(got[0])
                    held = (got[1].st_dev, got[1].st_ino) == key[2:4]
            if not held:
                with self._lock:
                    e = self._maps.get(key)
                    if e is not None and e[1] == 0:
                        del self._maps[key]
                        _libc_calls()[2](e[0], key[4])

    def close(self):
        """Unmaps every one (the rank left)."""
        with self._lock:
            maps, self._maps = self._maps, {}
        for key, e in maps.items():
            _libc_calls()[2](e[0], key[4])


def _read_block(readv, x, which, to, block, seen, local, remote):
    """Reads block `which` of the rank whose descriptor is x into address `to`, with its
    nonce in the same system call: whether it came whole from that process (block 0: the
    nonce alone)."""
    seen.value = 0
    local[1].base, local[1].len = to, block
    remote[0].base, remote[0].len = x[W_NONCE_ADDR], 8
    remote[1].base, remote[1].len = x[W_BLOCKS + which], block
    got = readv(x[W_PID_FITS] & 0xFFFFFFFF, local, 2, remote, 2, 0)
    return got == 8 + block and seen.value == x[W_NONCE]


def pull(kind, n, rank, root, d, words, block, outs, ins, maps):
    """Reads this rank's blocks from the others (all_to_all and all_gather: every other
    rank's; a gather's root: every other rank's; a scatter's other ranks: the root's)
    into outs (its output's block addresses) and copies its own from ins (its input's):
    True, or False if any could not be read whole from the process that holds its rank's
    nonce. block: the bytes of every block, or a list of the bytes this rank takes from
    each rank (an uneven all_to_all's pairs, its own block's too). maps: where the
    segments of ranks that offer them (FITS_SEGMENT) are mapped."""
    readv = _process_vm_readv()
    which = rank if blocks_per_rank(kind) else 0
    sizes = block if isinstance(block, list) else [block] * n
    seen = ctypes.c_uint64(0)
    local = (_Iovec * 2)()
    remote = (_Iovec * 2)()
    local[0].base, local[0].len = ctypes.addressof(seen), 8

    def nonce_ok(x):
        return _read_block(readv, x, which, None, 0, seen, local, remote)

    def read(i, to):
        x = d[i * words:(i + 1) * words]
        size = sizes[i]
        if not size:
            return True
        if x[W_PID_FITS] & FITS_SEGMENT and maps.read(x, which, to, size, nonce_ok):
            return True
        return _read_block(readv, x, which, to, size, seen, local, remote)

    since = maps.clock()
    try:
        return _pull_blocks(kind, n, rank, root, which, read, outs, ins, sizes[rank])
    finally:
        # Segments another rank freed are let go at this rank's next peer copy.
        maps.sweep(since)


def _pull_blocks(kind, n, rank, root, which, read, outs, ins, own):
    """pull's reads (read(rank, address)) and own block (of `own` bytes)."""
    if kind == SCATTER and rank != root:
        return read(root, outs[0])
    if kind == GATHER and rank != root:
        return True  # it only lends its input
    for k in range(1, n if kind != SCATTER else 1):
        i = (rank + k) % n  # not every rank at rank 0 first
        if not read(i, outs[i]):
            return False
    to = outs[0] if kind == SCATTER else outs[rank]
    if to != ins[which] and own:
        ctypes.memmove(to, ins[which], own)
    return True
