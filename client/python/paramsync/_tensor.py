"""Tensors as byte buffers: numpy arrays and torch CPU tensors, viewed in place.

Nothing here computes on elements: a tensor becomes a writable memoryview of
its bytes plus its wire dtype, and the daemon does every reduction.
"""
import sys

import numpy as np

# Wire dtype codes: paramsync.v1.DType.
FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT8, UINT8, INT16, INT32, INT64, BOOL = range(10)

NAMES = {
    FLOAT32: "float32", FLOAT64: "float64", FLOAT16: "float16", BFLOAT16: "bfloat16",
    INT8: "int8", UINT8: "uint8", INT16: "int16", INT32: "int32", INT64: "int64", BOOL: "bool",
}
SIZES = {FLOAT32: 4, FLOAT64: 8, FLOAT16: 2, BFLOAT16: 2, INT8: 1, UINT8: 1, INT16: 2,
         INT32: 4, INT64: 8, BOOL: 1}
FLOATING = frozenset({FLOAT32, FLOAT64, FLOAT16, BFLOAT16})

_NUMPY = {
    np.dtype(np.float32): FLOAT32, np.dtype(np.float64): FLOAT64, np.dtype(np.float16): FLOAT16,
    np.dtype(np.int8): INT8, np.dtype(np.uint8): UINT8, np.dtype(np.int16): INT16,
    np.dtype(np.int32): INT32, np.dtype(np.int64): INT64, np.dtype(np.bool_): BOOL,
}
_NUMPY_BACK = {v: k for k, v in _NUMPY.items()}

_SUPPORTED = ", ".join(NAMES[c] for c in sorted(NAMES))


def _torch():
    """torch if the program has imported it (never imported here on our own)."""
    return sys.modules.get("torch")


def _torch_map(torch):
    return {
        torch.float32: FLOAT32, torch.float64: FLOAT64, torch.float16: FLOAT16,
        torch.bfloat16: BFLOAT16, torch.int8: INT8, torch.uint8: UINT8, torch.int16: INT16,
        torch.int32: INT32, torch.int64: INT64, torch.bool: BOOL,
    }


def to_wire(dtype):
    """The wire dtype code of a numpy or torch dtype (or a dtype name); TypeError if unsupported."""
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        code = _torch_map(torch).get(dtype)
        if code is None:
            raise TypeError("paramsync does not support %s (supported: %s)" % (dtype, _SUPPORTED))
        return code
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    try:
        nd = np.dtype(dtype)
    except TypeError:
        raise TypeError("not a dtype: %r" % (dtype,)) from None
    code = _NUMPY.get(nd)
    if code is None or not nd.isnative:
        raise TypeError("paramsync does not support numpy dtype %s (supported: %s; bfloat16 "
                        "with torch only)" % (nd, _SUPPORTED))
    return code


def from_wire(code, library="numpy"):
    """The numpy (library="numpy") or torch (library="torch") dtype of a wire code."""
    if code not in NAMES:
        raise ValueError("invalid wire dtype %r" % (code,))
    if library == "torch":
        import torch
        return {v: k for k, v in _torch_map(torch).items()}[code]
    if library != "numpy":
        raise ValueError("library must be 'numpy' or 'torch'")
    if code == BFLOAT16:
        raise TypeError("numpy has no bfloat16; use torch.bfloat16")
    return _NUMPY_BACK[code]


class Buf:
    """One tensor as bytes: `mv` is a flat uint8 memoryview sharing its memory."""
    __slots__ = ("tensor", "dtype", "numel", "mv", "arr")

    def __init__(self, tensor, dtype, numel, arr):
        self.tensor = tensor
        self.dtype = dtype
        self.numel = numel
        self.arr = arr  # flat uint8 numpy view (for overlap checks)
        self.mv = memoryview(arr)

    @property
    def nbytes(self):
        return self.numel * SIZES[self.dtype]


def view(tensor, what="tensor", writable=False):
    """A Buf over tensor's memory. TypeError for what is not a supported tensor,
    ValueError for a non-contiguous or read-only one (outputs are written in place)."""
    torch = _torch()
    if isinstance(tensor, np.ndarray):
        code = _NUMPY.get(tensor.dtype)
        if code is None or not tensor.dtype.isnative:
            raise TypeError("%s: paramsync does not support numpy dtype %s (supported: %s; "
                            "bfloat16 with torch only)" % (what, tensor.dtype, _SUPPORTED))
        if not tensor.flags.c_contiguous:
            raise ValueError("%s: tensors must be contiguous (use numpy.ascontiguousarray)" % what)
        if writable and not tensor.flags.writeable:
            raise ValueError("%s: the array is read-only but receives a result" % what)
        arr = tensor.reshape(-1).view(np.uint8)
        return Buf(tensor, code, tensor.size, arr)
    if torch is not None and isinstance(tensor, torch.Tensor):
        code = _torch_map(torch).get(tensor.dtype)
        if code is None:
            raise TypeError("%s: paramsync does not support %s (supported: %s)"
                            % (what, tensor.dtype, _SUPPORTED))
        if tensor.device.type != "cpu":
            raise TypeError("%s: only CPU tensors are supported, not %s" % (what, tensor.device))
        if tensor.layout != torch.strided:
            raise TypeError("%s: only dense (strided) tensors are supported, not %s"
                            % (what, tensor.layout))
        if not tensor.is_contiguous():
            raise ValueError("%s: tensors must be contiguous (use .contiguous())" % what)
        t = tensor.detach()
        if code == BFLOAT16:
            t = t.view(torch.int16)  # numpy has no bfloat16; same bytes
        arr = t.numpy().reshape(-1).view(np.uint8)
        return Buf(tensor, code, tensor.numel(), arr)
    kind = type(tensor).__module__ + "." + type(tensor).__qualname__
    if kind.startswith("torch.") and torch is None:
        kind += " (torch is not imported)"
    raise TypeError("%s must be a numpy.ndarray or a torch CPU tensor, not %s" % (what, kind))


def is_tensor(obj):
    torch = _torch()
    return isinstance(obj, np.ndarray) or (torch is not None and isinstance(obj, torch.Tensor))


class Segments:
    """A payload made of several buffers laid end to end (e.g. a list of tensors)."""
    __slots__ = ("mvs", "starts", "total", "addrs")

    def __init__(self, bufs):
        self.mvs = [b.mv for b in bufs if b.nbytes]
        self.starts = []
        pos = 0
        for mv in self.mvs:
            self.starts.append(pos)
            pos += len(mv)
        self.total = pos
        self.addrs = None  # the buffers' addresses, once _shm.addresses worked them out

    def copy(self):
        """The same payload in memory of its own."""
        c = Segments(())
        c.mvs = [memoryview(bytearray(mv)) for mv in self.mvs]
        c.starts = list(self.starts)
        c.total = self.total
        return c

    def chunks(self, size):
        """Yields the payload as bytes objects of `size` bytes (the last one shorter)."""
        pending = []
        have = 0
        for mv in self.mvs:
            pos = 0
            n = len(mv)
            while pos < n:
                take = min(size - have, n - pos)
                pending.append(mv[pos:pos + take])
                have += take
                pos += take
                if have == size:
                    yield pending[0].tobytes() if len(pending) == 1 else b"".join(pending)
                    pending = []
                    have = 0
        if have:
            yield pending[0].tobytes() if len(pending) == 1 else b"".join(pending)

    def write(self, offset, data):
        """Copies data to byte `offset` of the payload. Returns False if it does not fit."""
        end = offset + len(data)
        if end > self.total:
            return False
        src = memoryview(data)
        done = 0
        # First segment that holds `offset`.
        i = 0
        while i + 1 < len(self.starts) and self.starts[i + 1] <= offset:
            i += 1
        while done < len(data):
            mv = self.mvs[i]
            at = offset + done - self.starts[i]
            take = min(len(mv) - at, len(data) - done)
            mv[at:at + take] = src[done:done + take]
            done += take
            i += 1
        return True


def overlaps(a_bufs, b_bufs):
    """True if any buffer of a shares memory with any of b."""
    for a in a_bufs:
        for b in b_bufs:
            if a.nbytes and b.nbytes and np.shares_memory(a.arr, b.arr):
                return True
    return False
