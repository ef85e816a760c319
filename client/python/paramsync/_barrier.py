"""Direct barriers, as the C client meets them (client/barrier.c, the layout and steps
there are shared): the ranks of a group that all joined through one agent from one PID
namespace, with clients that do this (JoinEvent.barrier_sets), meet at a barrier on a page
of shared memory they all map, without the agent. The first two such barriers of a group
set the page up through the agent (an all_gather of rank 0's name for it, an all_reduce
MIN of whether each rank mapped it); from the third on they meet on the page. A rank raises
its word of arrived[] to the barrier's sequence number + 1, reads the others', and the one that finds all there raises gen and
wakes the others (a futex on gen). The arrivals say a barrier is met; gen only wakes, since
this module, without an atomic maximum across processes, may lower it for a moment.
other[] holds one more than the number of each rank's last other call: a rank whose
word is m called another collective where the others called direct barrier m, and a
waiter that sees it takes its barrier to the agent, where the hub fails both sides at
once."""

import mmap
import os
import struct
import threading
import time

from . import _shm

PAGE = 4096
NAME = 64  # bytes of rank 0's name in the setup's all_gather
GEN = 0
ARRIVED = 64
MAX_RANKS = (PAGE - ARRIVED) // 8  # two words a rank
OTHER = ARRIVED + 4 * MAX_RANKS
SLICE_S = 0.05
PENDING, MET, MISMATCH = range(3)


def wanted():
    """JoinRequest.direct_barrier (asked along with peer copies): not with
    PARAMSYNC_DIRECT_BARRIER=0 nor PARAMSYNC_SHM=0, nor without futexes here."""
    return (os.environ.get("PARAMSYNC_DIRECT_BARRIER") != "0" and _shm.enabled() and
            _shm._syscall() is not None)


def takes(sets, ranks, me):
    """Whether a barrier of the group `ranks` (job ranks) may meet directly: every rank has
    the caller's nonzero number in the barrier sets. Alike on every rank of the group."""
    if not sets or len(ranks) > MAX_RANKS:
        return False
    mine = sets[me]
    return mine != 0 and all(sets[r] == mine for r in ranks)


def _behind(a, m):
    """a < m, as 32-bit counters that wrap."""
    return ((a - m) & 0xFFFFFFFF) >= 0x80000000


class Group:
    """One group's direct barriers: the calls counted (under the World's lock), the setup's
    progress, and the page (once setup step 2 has ended here, None means through the
    agent)."""

    def __init__(self):
        self.calls = 0
        self.cond = threading.Condition(threading.Lock())
        self.setup = 0  # setup steps ended here
        self.words = None  # _shm.Words of the page
        self.name = None  # rank 0's name of the page until it unlinks it
        self._own = threading.Lock()  # this process's writes of its arrival word

    def ended(self, step):
        with self.cond:
            self.setup = step
            self.cond.notify_all()

    def wait_setup(self, step):
        with self.cond:
            while self.setup < step:
                self.cond.wait()

    def _map(self, fd):
        if os.fstat(fd).st_size != PAGE:
            raise OSError("the barrier page has the wrong size")
        self.words = _shm.Words(mmap.mmap(fd, PAGE, mmap.MAP_SHARED,
                                          mmap.PROT_READ | mmap.PROT_WRITE))

    def make(self):
        """Group rank 0: makes the page; its name as NAME bytes (zeros when it cannot)."""
        self.name = "/paramsync.%d.bar.%d.%x" % (os.getpid(), id(self) & 0xFFFF,
                                                  time.monotonic_ns() & 0xFFFFFF)
        try:
            fd = _shm._shm_open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            self.name = None
            return bytes(NAME)
        try:
            os.ftruncate(fd, PAGE)
            self._map(fd)
        except OSError:
            self.unlink()
            return bytes(NAME)
        finally:
            os.close(fd)
        return self.name.encode().ljust(NAME, b"\0")

    def open(self, record):
        """The other ranks: maps the page rank 0 named (nothing when it named none)."""
        name = bytes(record).split(b"\0", 1)[0].decode(errors="replace")
        if not name.startswith("/paramsync."):  # only a name such as rank 0 makes
            return
        try:
            fd = _shm._shm_open(name, os.O_RDWR, 0)
        except OSError:
            return
        try:
            self._map(fd)
        except (OSError, ValueError):
            self.words = None
        finally:
            os.close(fd)

    def unlink(self):
        if self.name:
            try:
                _shm._shm_unlink(self.name)
            except OSError:
                pass
        self.name = None

    def close(self):
        self.unlink()
        if self.words is not None:
            self.words.close()
            self.words = None

    def started(self, me, seq):
        """Once a call other than a direct barrier has its (first) sequence number, under
        the World's lock: says so on the page (other[]), once there is one. A peer copy's
        first number is its all_gather of addresses through the agent."""
        if self.setup >= 2 and self.words is not None:
            struct.pack_into("=I", self.words.map, OTHER + 4 * me, (seq + 1) & 0xFFFFFFFF)

    @staticmethod
    def _arrivals(w, n, m):
        """MET when all n ranks called direct barrier m, MISMATCH when one called another
        collective under its number, else PENDING."""
        got = MET
        for i in range(n):
            if w.u32(OTHER + 4 * i) == m:
                return MISMATCH
            if _behind(w.u32(ARRIVED + 4 * i), m):
                got = PENDING
        return got

    def missing(self, ranks, m):
        w = self.words
        return [r for i, r in enumerate(ranks)
                if _behind(w.u32(ARRIVED + 4 * i), m) or w.u32(OTHER + 4 * i) == m]

    def meet(self, me, n, m, deadline, broken):
        """Direct barrier m (its sequence number + 1): True once all n ranks called it,
        False when one called another collective under its number (the barrier is then to
        go to the agent); raises broken()'s error, or TimeoutError at the deadline
        (time.monotonic())."""
        w = self.words  # kept, should the rank leave meanwhile
        with self._own:  # a lock's acquire and release order the word against the reads
            if _behind(w.u32(ARRIVED + 4 * me), m):
                struct.pack_into("=I", w.map, ARRIVED + 4 * me, m)
        with self._own:
            pass
        got = self._arrivals(w, n, m)
        if got != PENDING:
            if got == MET and _behind(w.u32(GEN), m):
                struct.pack_into("=I", w.map, GEN, m)
            w.futex(GEN, _shm._FUTEX_WAKE, 0x7FFFFFFF)
            return got == MET
        while True:
            err = broken()
            try:
                seen = w.u32(GEN)
                got = self._arrivals(w, n, m)
                if got == MISMATCH:  # the others waiting see it now, not a slice later
                    w.futex(GEN, _shm._FUTEX_WAKE, 0x7FFFFFFF)
                    return False
                if not _behind(seen, m) or got == MET:
                    return True
            except ValueError:  # unmapped meanwhile: this rank left
                if err is None:
                    err = broken()
                if err is None:
                    raise
            if err is not None:
                raise err
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            w.futex(GEN, _shm._FUTEX_WAIT, seen, min(left, SLICE_S))
