"""Peer copies: large all_to_all and all_gather calls whose ranks all share one agent copy
each block once, rank to rank, with process_vm_readv (the C client's client/peer.c, whose
rules and descriptor layout these are, so C and Python ranks take part together).

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
import struct

MIN_ALL_TO_ALL = 2 << 20  # bytes of output, as client/peer.c
MIN_ALL_GATHER = 4 << 20
MAX_ALL_TO_ALL_RANKS = 64
MAGIC = 0x3170656572737370
W_MAGIC, W_PIDNS_DEV, W_PIDNS_INO, W_NONCE_ADDR, W_NONCE, W_PID_FITS, W_BLOCKS = range(7)
SEQS = 3  # sequence numbers a call that takes this path holds


def wanted():
    """(ask, pid namespace inode) for JoinRequest.peer_copies and pid_namespace: not with
    PARAMSYNC_PEER_COPY=0 or PARAMSYNC_SHM=0, nor under Yama ptrace_scope 1 or more (a
    process may then read only its descendants)."""
    if os.environ.get("PARAMSYNC_PEER_COPY") == "0" or os.environ.get("PARAMSYNC_SHM") == "0":
        return False, 0
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return False, 0
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().split()[0])
    except FileNotFoundError:
        scope = 0
    except (OSError, ValueError, IndexError):
        scope = 1
    return scope == 0, ino if scope == 0 else 0


def takes(kind_all_to_all, out_bytes, sets, group_ranks, rank):
    """Whether a call takes peer copies: its output is large enough and every rank of its
    group (job ranks group_ranks) is in this rank's (job rank `rank`) peer-copy set."""
    n = len(group_ranks)
    if not sets or n < 2 or out_bytes < (MIN_ALL_TO_ALL if kind_all_to_all else MIN_ALL_GATHER):
        return False
    if kind_all_to_all and n > MAX_ALL_TO_ALL_RANKS:
        return False
    mine = sets[rank]
    return mine != 0 and all(sets[r] == mine for r in group_ranks)


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


class Nonce:
    """A random number at a fixed address of this process: peers read it, in the same
    system call as a block, to know they read this process."""

    def __init__(self):
        self.value = int.from_bytes(os.urandom(8), "little")
        self._cell = ctypes.c_uint64(self.value)
        self.address = ctypes.addressof(self._cell)


def describe(nonce, ins, fits):
    """This rank's descriptor (bytes): ins the addresses of its input's blocks (an
    all_to_all's n, an all_gather's one); fits: its buffers suit peer copies."""
    st = os.stat("/proc/self/ns/pid")
    words = [MAGIC, st.st_dev, st.st_ino, nonce.address, nonce.value,
             (os.getpid() & 0xFFFFFFFF) | (int(bool(fits)) << 32)]
    words += ins
    return struct.pack("=%dQ" % len(words), *words)


def all_fit(descs, n, words):
    """Whether every rank of the descriptors (bytes of n x words 64-bit words) may be read."""
    d = struct.unpack("=%dQ" % (n * words), descs)
    for i in range(n):
        x = d[i * words:(i + 1) * words]
        if (x[W_MAGIC] != MAGIC or not x[W_PID_FITS] >> 32 or not x[W_PID_FITS] & 0xFFFFFFFF
                or not x[W_PIDNS_INO] or x[W_PIDNS_DEV] != d[W_PIDNS_DEV]
                or x[W_PIDNS_INO] != d[W_PIDNS_INO]):
            return None
    return d


def pull(all_to_all, n, rank, d, words, block, outs, own_from):
    """Reads this rank's blocks from the others into outs (the n block addresses of its
    output) and copies its own from own_from: True, or False if any could not be read
    whole from the process that holds its rank's nonce."""
    readv = _process_vm_readv()
    mine = rank if all_to_all else 0
    seen = ctypes.c_uint64(0)
    local = (_Iovec * 2)()
    remote = (_Iovec * 2)()
    local[0].base, local[0].len = ctypes.addressof(seen), 8
    for k in range(1, n):
        i = (rank + k) % n  # not every rank at rank 0 first
        x = d[i * words:(i + 1) * words]
        seen.value = 0
        local[1].base, local[1].len = outs[i], block
        remote[0].base, remote[0].len = x[W_NONCE_ADDR], 8
        remote[1].base, remote[1].len = x[W_BLOCKS + mine], block
        got = readv(x[W_PID_FITS] & 0xFFFFFFFF, local, 2, remote, 2, 0)
        if got != 8 + block or seen.value != x[W_NONCE]:
            return False
    if outs[rank] != own_from:
        ctypes.memmove(outs[rank], own_from, block)
    return True
