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
import struct

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
    mine = sets[rank]
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


def describe(me, ins, fits):
    """This rank's descriptor (bytes): me its Self, ins the addresses of its input's blocks
    (an all_to_all's or scatter root's n, an all_gather's or gather's one); fits: its
    buffers suit peer copies."""
    words = [MAGIC, me.pidns_dev, me.pidns_ino, me.nonce_address, me.nonce,
             (os.getpid() & 0xFFFFFFFF) | (FITS_HOST if fits else 0)]
    words += [0] * (W_BLOCKS - len(words))
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


def _read_block(readv, x, which, to, block, seen, local, remote):
    """Reads block `which` of the rank whose descriptor is x into address `to`, with its
    nonce in the same system call: whether it came whole from that process."""
    seen.value = 0
    local[1].base, local[1].len = to, block
    remote[0].base, remote[0].len = x[W_NONCE_ADDR], 8
    remote[1].base, remote[1].len = x[W_BLOCKS + which], block
    got = readv(x[W_PID_FITS] & 0xFFFFFFFF, local, 2, remote, 2, 0)
    return got == 8 + block and seen.value == x[W_NONCE]


def pull(kind, n, rank, root, d, words, block, outs, ins):
    """Reads this rank's blocks from the others (all_to_all and all_gather: every other
    rank's; a gather's root: every other rank's; a scatter's other ranks: the root's)
    into outs (its output's block addresses) and copies its own from ins (its input's):
    True, or False if any could not be read whole from the process that holds its rank's
    nonce."""
    readv = _process_vm_readv()
    which = rank if blocks_per_rank(kind) else 0
    seen = ctypes.c_uint64(0)
    local = (_Iovec * 2)()
    remote = (_Iovec * 2)()
    local[0].base, local[0].len = ctypes.addressof(seen), 8

    def block_of(i):
        return d[i * words:(i + 1) * words]
    if kind == SCATTER and rank != root:
        return _read_block(readv, block_of(root), which, outs[0], block, seen, local, remote)
    if kind == GATHER and rank != root:
        return True  # it only lends its input
    for k in range(1, n if kind != SCATTER else 1):
        i = (rank + k) % n  # not every rank at rank 0 first
        if not _read_block(readv, block_of(i), which, outs[i], block, seen, local, remote):
            return False
    to = outs[0] if kind == SCATTER else outs[rank]
    if to != ins[which]:
        ctypes.memmove(to, ins[which], block)
    return True
