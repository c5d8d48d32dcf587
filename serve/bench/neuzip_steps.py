"""`manyfold bench neuzip`'s engine steps: what a NeuZip base costs per forward through the engine's own runtime.

SmolLM2-135M as bf16 and as lossless NeuZip (k = 7) at decoded-layer budget 0, each a BaseModelRuntime: a decode
step (one new token a row over a 64-token context) at 1, 8, 32, 64 and 128 rows, and a prefill of 8 x 256
tokens. NeuZip runs both ways serve/engine/neuzip/decoder.py has, whatever the forward's length: "ahead" (a
decode thread, torch on one thread fewer) and "inline" (decoding on torch's threads), and as a server runs it
("k7": the way measured faster for the forward's size, inline beyond AHEAD_MAX_TOKENS), after 2 x TRIALS
untimed forwards of each step, so that its choice is made. Each forward is split into
  decode wait   the compute thread's time getting weights (decoding them, or waiting for the decode thread)
  decode busy   time spent decoding on any thread (above the wait where decoding runs ahead, under compute)
  matmul        time inside every Linear's forward (the base's matmuls and the LM head)
  other         the rest: attention, norms, embeddings, hooks, Python
Before anything is timed, the k = 7 logits are checked equal to bf16's bit for bit. The runtimes take turns
forward by forward, so a busy moment on a shared machine falls on both alike; medians over the repeats.
"""

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache

from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.model import BaseModelRuntime
from serve.engine.neuzip.decoder import TRIALS

ROWS = (1, 8, 32, 64, 128)
CONTEXT = 64
PREFILL = (8, 256)
PARTS = ("step", "decode_wait", "decode_busy", "matmul", "other")
CONFIGS = {"bf16": ("bf16", None), "k7 ahead": ("k7", "ahead"), "k7 inline": ("k7", "inline"), "k7": ("k7", None)}
"""name: (model directory, the decoder's way: always ahead, always inline, or as served: measured per size)."""


class LinearTimer:
    """Seconds inside every Linear's forward, through hooks registered after the runtime's own (so the decode
    pre-hook has run when the clock starts)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        self._t0 = 0.0
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self._handles = [h for m in linears for h in (m.register_forward_pre_hook(self._start),
                                                      m.register_forward_hook(self._stop, always_call=True))]

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - self._t0

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def forward_of(rt: BaseModelRuntime, rows: int) -> Callable[[], torch.Tensor]:
    """A forward to time, returning its last logits: a decode step over a CONTEXT-token cache (cropped back after
    each step, so that every timed step is the same step), or for rows == 0 the PREFILL."""
    g = torch.Generator().manual_seed(rows)
    vocab = rt.model.config.vocab_size
    if not rows:
        ids = torch.randint(0, vocab, PREFILL, generator=g).to(rt.device)
        plan = BatchPlan([BASE_ROW] * PREFILL[0], rt.device)
        return lambda: rt.call(plan, input_ids=ids, logits_to_keep=1).logits
    ids = torch.randint(0, vocab, (rows, CONTEXT), generator=g).to(rt.device)
    plan = BatchPlan([BASE_ROW] * rows, rt.device)
    cache = DynamicCache()
    with torch.no_grad():
        nxt = rt.call(plan, input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def step() -> torch.Tensor:
        logits = rt.call(plan, input_ids=nxt, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)
        return logits

    return step


@torch.no_grad()
def timed(rt: BaseModelRuntime, timer: LinearTimer, fn: Callable[[], torch.Tensor]) -> dict[str, float]:
    """One forward, split (seconds)."""
    decoder = rt.coded.decoder if rt.coded else None
    wait0, busy0 = (decoder.wait_s, decoder.decode_s) if decoder else (0.0, 0.0)
    mm0 = timer.seconds
    t0 = time.perf_counter()
    fn()
    step = time.perf_counter() - t0
    wait, busy = (decoder.wait_s - wait0, decoder.decode_s - busy0) if decoder else (0.0, 0.0)
    matmul = timer.seconds - mm0
    return {"step": step, "decode_wait": wait, "decode_busy": busy, "matmul": matmul, "other": step - wait - matmul}


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def bf16_references(rt: BaseModelRuntime, rows: int) -> dict[str, list[torch.Tensor]]:
    """bf16's logits of forward_of(rt, rows) as each NeuZip way computes them: decoding ahead runs torch on one
    thread fewer, and a matmul split over fewer threads may sum in another order (on an Intel Xeon with 2 cores, 8
    rows' logits move by up to 0.84 in bf16, through the prefilled cache). -> the way's name: the logits it must
    equal bit for bit (inline: on every thread; ahead: on one fewer; as served: any of its prefill's and step's
    choices)."""
    full = torch.get_num_threads()
    fewer = max(1, full - 1)
    out = {}
    for prefill, step in ((full, full), (fewer, fewer), (full, fewer)):
        with _threads(prefill):
            fn = forward_of(rt, rows)
        with _threads(step):
            out[prefill, step] = fn()
    return {"k7 inline": [out[full, full]], "k7 ahead": [out[fewer, fewer]], "served": list(out.values())}


@torch.no_grad()
def check_and_warm(fns: dict[str, Callable[[], torch.Tensor]], shape: str, warm: int,
                   want: dict[str, list[torch.Tensor]]) -> None:
    """Check every NeuZip k7 forward's logits equal bf16's bit for bit, computed on as many threads
    (bf16_references), then run every forward `warm` more times untimed, in turns (a served k7 times both ways
    over its first forwards of a size, then keeps one)."""
    differ = [c for c, fn in fns.items() if c.startswith("k7")
              and not any(torch.equal(fn(), w) for w in want.get(c, want["served"]))]
    if differ:
        raise RuntimeError(f"{shape}: NeuZip logits of {', '.join(differ)} differ from bf16's on as many threads")
    for _ in range(warm):
        for fn in fns.values():
            fn()


def _runtimes(dirs: dict[str, Path]) -> dict[str, BaseModelRuntime]:
    rts = {}
    for name, (d, way) in CONFIGS.items():
        rt = rts[name] = BaseModelRuntime(name, dirs[d])
        if d == "k7":
            if rt.coded is None or rt.coded.kept:
                raise RuntimeError(f"{name}: every coded weight must be decoded on use (budget 0)")
            rt.coded.decoder.way = way
            if way == "ahead":
                rt.coded.decoder.ahead_max_tokens = 1 << 30
    return rts


def run_steps(dirs: dict[str, Path], repeats: int = 9, rows: tuple[int, ...] = ROWS) -> dict:
    """{config: {forward: {part: median ms}}} for the decode step at each of `rows` and the prefill."""
    rts = _runtimes(dirs)
    timers = {c: LinearTimer(rt.model) for c, rt in rts.items()}
    out: dict = {c: {} for c in rts}
    try:
        for n in (*rows, 0):
            shape = f"step {n}" if n else f"prefill {PREFILL[0]}x{PREFILL[1]}"
            fns = {c: forward_of(rt, n) for c, rt in rts.items()}
            check_and_warm(fns, shape, 2 * TRIALS if n else 0,  # prefill: always inline, nothing to choose
                           bf16_references(rts["bf16"], n))
            runs: dict[str, list] = {c: [] for c in rts}
            for _ in range(repeats if n else repeats // 2 + 1):
                for c, rt in rts.items():
                    runs[c].append(timed(rt, timers[c], fns[c]))
            for c, r in runs.items():
                out[c][shape] = {p: 1e3 * statistics.median(x[p] for x in r) for p in PARTS}
    finally:
        for c, rt in rts.items():
            timers[c].close()
            if rt.coded:
                rt.coded.close()
    return out


def print_steps(steps: dict) -> None:
    print(f"\nengine forwards, SmolLM2 (step N: one new token for each of N rows over {CONTEXT} tokens), ms, "
          "medians; decode busy above wait: decoding ran ahead, under compute")
    print(f"{'forward':<16}{'config':<11}{'total':>8}{'wait':>8}{'busy':>8}{'matmul':>8}{'other':>8}{'x bf16':>8}")
    for shape, b in steps["bf16"].items():
        for c, r in steps.items():
            k = r[shape]
            print(f"{shape:<16}{c:<11}{k['step']:>8.1f}{k['decode_wait']:>8.1f}{k['decode_busy']:>8.1f}"
                  f"{k['matmul']:>8.1f}{k['other']:>8.1f}{k['step'] / b['step']:>8.2f}")


FRONTIER_ROWS = (8, 64)
SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Shares of the coded weights' bf16 bytes kept decoded, for the frontier."""


def _frontier_runtimes(dirs: dict[str, Path]) -> tuple[dict[str, BaseModelRuntime], dict[str, int]]:
    """(bf16, int8 and lossless NeuZip at each share, their resident weight bytes)."""
    from serve.bench.neuzip import _int8, _weight_bytes

    rts = {"bf16": BaseModelRuntime("bf16", dirs["bf16"]), "int8": BaseModelRuntime("int8", dirs["bf16"])}
    _int8(rts["int8"].model)
    size = None
    for share in SHARES:
        rt = BaseModelRuntime(f"k7 {share:.0%}", dirs["k7"], decoded_bytes=int(share * (size or 0)))
        size = size or rt.coded.decoded_size
        rts[rt.name] = rt
    return rts, {c: _weight_bytes(rt.model) if c == "int8" else rt.nbytes for c, rt in rts.items()}


def run_frontier(dirs: dict[str, Path], repeats: int = 7) -> dict:
    """{config: {"resident_bytes", "step_ms": {rows: median}}} for bf16, int8 (torchao, weight-only) and lossless
    NeuZip kept decoded at each of SHARES, through the engine's runtime, taking turns forward by forward."""
    rts, nbytes = _frontier_runtimes(dirs)
    out = {c: {"resident_bytes": nbytes[c], "step_ms": {}} for c in rts}
    try:
        for n in FRONTIER_ROWS:
            fns = {c: forward_of(rt, n) for c, rt in rts.items()}
            check_and_warm(fns, f"step {n}", 2 * TRIALS, bf16_references(rts["bf16"], n))
            runs: dict[str, list[float]] = {c: [] for c in rts}
            with torch.no_grad():
                for _ in range(repeats):
                    for c, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        runs[c].append(time.perf_counter() - t0)
            for c, r in runs.items():
                out[c]["step_ms"][n] = 1e3 * statistics.median(r)
        for c, rt in rts.items():
            if rt.coded and rt.coded.streams:
                out[c]["way"] = {n: rt.coded.decoder.ways.chosen().get(n, "?") for n in FRONTIER_ROWS}
    finally:
        for rt in rts.values():
            if rt.coded:
                rt.coded.close()
    return out


def print_frontier(frontier: dict) -> None:
    bf16 = frontier["bf16"]
    print("\nfrontier, SmolLM2 decode steps (one new token a row over 64 tokens): resident weight bytes against "
          "tokens/s, lossless NeuZip kept decoded at each share of its coded weights; medians")
    print(f"{'config':<10}{'MB':>8}{'x bf16':>8}" + "".join(f"{f'tok/s {n}':>12}{'x bf16':>8}" for n in FRONTIER_ROWS)
          + "  way (8, 64 rows)")
    for c, r in frontier.items():
        cells = "".join(f"{1e3 * int(n) / r['step_ms'][n]:>12.1f}{bf16['step_ms'][n] / r['step_ms'][n]:>8.2f}"
                        for n in r["step_ms"])
        way = ", ".join(r.get("way", {}).values())
        print(f"{c:<10}{r['resident_bytes'] / 1e6:>8.1f}{r['resident_bytes'] / bf16['resident_bytes']:>8.2f}{cells}"
              f"  {way}")
