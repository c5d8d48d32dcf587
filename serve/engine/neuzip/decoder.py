"""A NeuZip base's coded weights decoded on use: what serve/engine/neuzip/coded.py's pre-hooks call for the weight of
the module about to run.

On the CPU every call was costing more than its decoding (tensor-to-numpy views, a scratch allocation, two
hand-offs to the decode pool, a fresh Parameter), so all of that is built once here: each weight's decode calls
(its lanes cut per thread, numpy views of its stream and of its place in a buffer) and its Parameter over that
place. Two ways to run them, chosen per forward (`forward`) by timing both over the first forwards of each
size (WayChooser): which is faster depends on the rows, on how many weights are still coded and on the machine.
- ahead, for forwards of few tokens (decode steps) when torch has two threads or more: a decode thread decodes
  the weights expected next (the modules that followed this one last time), up to AHEAD_WEIGHTS of them, each
  into a buffer of its own, while this one computes, and torch computes on one thread fewer, so that the two
  never fight over a core (torch's OpenMP threads spin between regions, and a third busy thread on their cores
  stalls every barrier). The queue evens out modules whose compute is shorter than the next weight's decoding
  with those whose compute is longer. Each weight is decoded in two halves of its lanes; a compute thread that
  needs it before the decode thread is done takes the half not yet started, so a step costs about
  max(decoding, compute), decoding on two cores wherever compute leaves one idle. A guess that turns out wrong
  costs only time: the queue is dropped and the weight asked for is decoded on the spot. The decode thread
  writes only buffers no running module reads (modules that decode are leaves: one runs at a time), so
  outputs are bit for bit those of inline decoding.
- inline, for long forwards (prefill), where compute needs every core and decoding is a small share, and for
  steps where few weights are still coded: the compute thread decodes each weight, its lanes split over
  torch's threads, then the module computes.
On another device serve/engine/neuzip/groups.py decodes instead.
"""

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kernels.neuzip_decode_cpu import decode_lanes, lane_cuts, run_split
from serve.codecs.neuzip_file import Stream

AHEAD_MAX_TOKENS = 256
"""Forwards of more tokens always decode inline: compute then needs every core (a prefill of 8 x 256 tokens
decoding ahead took 1.8x as long on 2 cores: serve/bench/neuzip_steps.py)."""
TRIALS = 3
"""Forwards timed each way, per size of forward, before the faster way is kept."""
AHEAD_WEIGHTS = 3
"""Weights decoded ahead at most: the queue's length, each in a buffer of the largest weight's size."""


class _Pending:
    """A weight being decoded ahead: its module, its buffer, its decode calls (lanes in parts) and which parts a
    thread has taken."""

    def __init__(self, module: str, buffer: int, fn: Callable, parts: list[tuple]):
        self.module, self.buffer, self.fn, self.parts = module, buffer, fn, parts
        self.seconds = 0.0
        """Spent decoding its parts, on either thread."""
        self.job: Future | None = None
        self._taken = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        """Decode the parts no thread has taken yet, one at a time: the decode thread runs this, and so does the
        compute thread once it needs the weight, so that the two split what is left (disjoint lanes)."""
        while True:
            with self._lock:
                i, self._taken = self._taken, self._taken + 1
            if i >= len(self.parts):
                return
            t0 = time.perf_counter()
            self.fn(*self.parts[i])
            with self._lock:
                self.seconds += time.perf_counter() - t0

    def cancel(self) -> None:
        """Start no part not yet started (a part being decoded finishes)."""
        with self._lock:
            self._taken = len(self.parts)


class WayChooser:
    """Ahead or inline, for a forward of n tokens. Which is faster depends on the rows (compute on one thread
    fewer against decoding under it), on the share of weights still coded and on the machine, so it is measured:
    over the first forwards of each size (tokens rounded up to a power of two) both ways take turns, TRIALS
    each, then the one with the lower median is kept for that size."""

    def __init__(self):
        self._seconds: dict[tuple[int, bool], list[float]] = {}

    @staticmethod
    def _size(tokens: int) -> int:
        return 1 << max(tokens - 1, 0).bit_length()

    def ahead(self, tokens: int) -> bool:
        size = self._size(tokens)
        ahead, inline = self._seconds.get((size, True), []), self._seconds.get((size, False), [])
        if len(ahead) >= TRIALS and len(inline) >= TRIALS:
            return statistics.median(ahead) < statistics.median(inline)
        return len(ahead) <= len(inline)

    def record(self, tokens: int, ahead: bool, seconds: float) -> None:
        times = self._seconds.setdefault((self._size(tokens), ahead), [])
        if len(times) < TRIALS:
            times.append(seconds)

    def chosen(self) -> dict[int, str]:
        """The way kept for each size measured both ways (for a benchmark's report)."""
        sizes = {size for size, _ in self._seconds}
        return {size: "ahead" if self.ahead(size) else "inline" for size in sorted(sizes)
                if all(len(self._seconds.get((size, a), [])) >= TRIALS for a in (True, False))}


class WeightDecoder:
    """Decodes the coded weights of one model on use, by module name (see the module's docstring)."""

    def __init__(self, streams: dict[str, Stream], device: torch.device, ahead_max_tokens: int = AHEAD_MAX_TOKENS,
                 ahead_weights: int = AHEAD_WEIGHTS):
        """streams: each coded weight's stream by the name of its module. ahead_max_tokens: forwards of at most
        this many tokens decode ahead (CPU only; 0: never), up to ahead_weights weights ahead."""
        if device.type != "cpu":
            raise ValueError(f"WeightDecoder decodes on the CPU; on {device} GroupDecoder does")
        self.streams = streams
        self.ahead_max_tokens = ahead_max_tokens
        size = max((s.numel for s in streams.values()), default=0)
        buffers = 1 + ahead_weights if self.ahead_max_tokens and streams else 1
        self.buffers = [torch.empty(size, dtype=torch.bfloat16, device=device) for _ in range(buffers)]
        self.params = {m: [torch.nn.Parameter(b[: s.numel].view(s.shape), requires_grad=False) for b in self.buffers]
                       for m, s in streams.items()}
        """Each weight's Parameter over its place in each buffer: installing one is a dict assignment."""
        self.decode_s = 0.0
        """Seconds spent decoding, on whichever thread (a counter: a reader subtracts two readings)."""
        self.wait_s = 0.0
        """Seconds the compute thread spent in weight(): decoding, or waiting for the decode thread."""
        self.ahead = False
        """Whether the forward running now decodes ahead (set by `forward`)."""
        self._threads = 1
        self._calls: dict[int, dict[str, list[list[tuple]]]] = {}
        self._next: dict[str, str] = {}
        self._last: str | None = None
        self._queue: deque[_Pending] = deque()
        """The weights decoding or decoded ahead, in the order they are expected."""
        self._current = 0
        """The buffer handed out last: its module may be running."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="neuzip-ahead") if len(self.buffers) > 1 else None
        self.ways = WayChooser()
        self.way: str | None = None
        """"ahead" or "inline" to always decode that way (benchmarks); None: as `ways` measures."""

    @property
    def nbytes(self) -> int:
        """The buffers' bytes (the streams are counted by their owner)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @contextmanager
    def forward(self, tokens: int) -> Iterator[None]:
        """Decode, for the forward run inside the block, ahead (torch then runs on one thread fewer) or inline on
        torch's threads: inline when it has more than ahead_max_tokens tokens or torch has no thread to spare,
        else the way measured faster for its size (WayChooser)."""
        threads = torch.get_num_threads()
        can = self._thread is not None and threads > 1 and tokens <= self.ahead_max_tokens
        self.ahead = can and (self.way == "ahead" or (self.way is None and self.ways.ahead(tokens)))
        self._threads = 1 if self.ahead else threads
        if self.ahead:
            torch.set_num_threads(threads - 1)
        t0 = time.perf_counter()
        try:
            yield
            if can:
                self.ways.record(tokens, self.ahead, time.perf_counter() - t0)
        finally:
            if self.ahead:
                torch.set_num_threads(threads)
            self.ahead, self._threads = False, 1

    def _plan(self, threads: int) -> dict[str, list[list[tuple]]]:
        """(module -> per buffer, the argument tuples of decode_lanes, one per thread): every view built once."""
        # scratch per buffer: two weights may be decoding at once (the queue's head and the one after it)
        exps = [np.empty(self.buffers[0].numel(), np.uint8) for _ in self.buffers]
        status = [np.zeros(max(s.offsets.numel() - 1 for s in self.streams.values()), np.int32) for _ in self.buffers]
        outs = [b.view(torch.int16).numpy().view(np.uint16) for b in self.buffers]
        calls = {}
        for m, s in self.streams.items():
            args = (s.words.numpy().view(np.uint16), s.offsets.numpy(), s.table.numpy().view(np.uint32), s.sm.numpy())
            cuts = lane_cuts(s.numel, s.offsets.numel() - 1, threads)
            calls[m] = [[(*args, e[: s.numel], out[: s.numel], lo, hi, st) for lo, hi in cuts]
                        for e, out, st in zip(exps, outs, status)]
        return calls

    def weight(self, module: str) -> torch.nn.Parameter:
        """The decoded weight of `module`, valid until the next call (the caller's module has run by then)."""
        t0 = time.perf_counter()
        if self._last is not None:
            self._next[self._last] = module
        self._last = module
        self._current = self._take(module)
        if self.ahead:
            self._top_up(module)
        self.wait_s += time.perf_counter() - t0
        return self.params[module][self._current]

    def _take(self, module: str) -> int:
        """The buffer holding `module`'s weight: the head of the queue if it was the one guessed, else decoded now
        (the queue, guessed wrong, dropped)."""
        if self._queue and self._queue[0].module == module:
            pending = self._queue.popleft()
            pending.run()
            pending.job.result()
            self.decode_s += pending.seconds
            return pending.buffer
        self._drop_queue()
        self._decode(module, 0, self._threads)
        return 0

    def _top_up(self, module: str) -> None:
        """Queue the weights expected after `module`, each into a buffer neither the queue nor `module` holds."""
        held = {self._current, *(p.buffer for p in self._queue)}
        free = [b for b in range(len(self.buffers)) if b not in held]
        expected = self._queue[-1].module if self._queue else module
        while free and (expected := self._next.get(expected)) is not None:
            self._start(expected, free.pop())

    def _drop_queue(self) -> None:
        for pending in self._queue:
            pending.cancel()
        for pending in self._queue:
            pending.job.result()
            self.decode_s += pending.seconds
        self._queue.clear()

    def _start(self, module: str, b: int) -> None:
        """Decode `module`'s weight into buffer b on the decode thread, in two parts (the compute thread may take
        the second)."""
        pending = _Pending(module, b, decode_lanes(self.streams[module].bits), self._calls_for(2)[module][b])
        pending.job = self._thread.submit(pending.run)
        self._queue.append(pending)

    def _calls_for(self, threads: int) -> dict[str, list[list[tuple]]]:
        if threads not in self._calls:
            self._calls[threads] = self._plan(threads)
        return self._calls[threads]

    def _decode(self, module: str, b: int, threads: int) -> None:
        t0 = time.perf_counter()
        run_split(decode_lanes(self.streams[module].bits), self._calls_for(threads)[module][b])
        self.decode_s += time.perf_counter() - t0

    def close(self) -> None:
        """Finish any decode ahead and stop the decode thread."""
        self._drop_queue()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
