"""BufferPool: host memory, already faulted in, that variant decodes write into (see the class)."""

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key_nbytes(key: tuple[torch.dtype, tuple[int, ...]]) -> int:
    return math.prod(key[1]) * key[0].itemsize


class BufferPool:
    """Host memory, already faulted in, for the next decode to write into.

    A freed 90 MB variant goes back to the OS, and the next decode faults every page in again: on the VMs
    measured here that is 25-210 ms, as long as the decode itself. So the pool keeps the buffers of evicted
    variants, and holds a reserve shaped like each base's largest variant: made at start, topped up off the
    request path after a decode has taken it (refill). A decode in flight already needs one variant's worth of
    memory beyond the cache's budget; the pool holds that room (max_bytes) instead of returning it. Buffers
    are matched by dtype and shape (the variants of one base share their tensors' shapes); over its size, it
    frees buffers beyond the reserve's count first, then those of the least recently returned shapes.
    """

    def __init__(self) -> None:
        self.max_bytes = 0
        self.free_bytes = 0
        self._free: OrderedDict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = OrderedDict()
        self._reserve: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
        self._lock = threading.Lock()  # decodes take from worker threads while the event loop returns

    def reserve(self, layout: Sequence[tuple[Sequence[int], torch.dtype]]) -> None:
        """Keep buffers for these (shape, dtype) ready: one variant's decode outputs. Adds to earlier reserves."""
        with self._lock:
            for shape, dtype in layout:
                key = (dtype, tuple(shape))
                self._reserve[key] = self._reserve.get(key, 0) + 1
            self.max_bytes = max(self.max_bytes, sum(n * _key_nbytes(k) for k, n in self._reserve.items()))

    def short(self) -> bool:
        with self._lock:
            return any(len(self._free.get(k, ())) < n for k, n in self._reserve.items())

    def refill(self) -> None:
        """Allocate and touch what the reserve lacks. Slow (page faults): call it off the event loop."""
        for key, n in list(self._reserve.items()):
            for _ in range(n):
                with self._lock:
                    if len(self._free.get(key, ())) >= n or self.free_bytes + _key_nbytes(key) > self.max_bytes:
                        break
                t = torch.empty(key[1], dtype=key[0]).zero_()  # zero_ writes every page: faulted in here
                self.put([t])

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, tuple(shape))
        with self._lock:
            buffers = self._free.get(key)
            if buffers:
                t = buffers.pop()
                self.free_bytes -= tensor_nbytes(t)
                if not buffers:
                    del self._free[key]
                return t
        return torch.empty(key[1], dtype=dtype)

    def clear(self) -> None:
        """Give every buffer back to the allocator."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0

    def put(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                key = (t.dtype, tuple(t.shape))
                self._free.setdefault(key, []).append(t)
                self._free.move_to_end(key)
                self.free_bytes += tensor_nbytes(t)
            while self.free_bytes > self.max_bytes:
                # Surplus over the reserve goes first, so one whole variant's set stays; then the stalest.
                key = next((k for k, ts in self._free.items() if len(ts) > self._reserve.get(k, 0)),
                           next(iter(self._free)))
                buffers = self._free[key]
                self.free_bytes -= tensor_nbytes(buffers.pop(0))
                if not buffers:
                    del self._free[key]
