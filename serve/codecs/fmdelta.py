"""FM-Delta: a lossless delta of one fine-tuned tensor against its base tensor (METHODS.md section 1).

Per element, with B the bit width (16 for bf16/fp16, 32 for fp32):
  map(u)  = u | 1<<(B-1) if the sign bit is 0, else ~u     (unsigned order == numeric order)
  p, r    = map(base), map(finetuned);  d = |r - p|
  symbol  = B if d == 0, B+1+k if r > p, B-1-k if r < p,  with k = floor(log2 d)   (alphabet 2B+1)
  raw     = the k bits of d below its leading one (uniform, stored verbatim)
Symbols are rANS-coded against one static model per tensor (serve.codecs.entropy). A tensor is cut into
chunks of CHUNK_ELEMS elements, each an independent pair of streams, so one tensor can be decoded alone and
chunks code in parallel. Pure integer maths: NaN payloads, +-Inf, -0.0 and denormals round-trip exactly.
"""

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from serve.codecs import entropy

CHUNK_ELEMS = 1 << 20
"""Elements per independent chunk: 4 MiB of fp32, small enough to spread one tensor over all cores."""
DELTA_BITS = {np.dtype(np.uint16): 16, np.dtype(np.uint32): 32}
"""Element bit width by the unsigned view of a float tensor: bf16 and fp16 are 16 bits, fp32 is 32."""


def alphabet_size(bits: int) -> int:
    return 2 * bits + 1


# The loops below are branch-free on the data: signs and delta directions are random, and a mispredicted
# branch per element costs more than the arithmetic. Work is in uint64 / int64; elements are <= 32 bits.

@njit(inline="always")
def _to_ordered(u, top, mask):
    """sign 0: u | top (== u ^ top); sign 1: ~u & mask (== u ^ mask)."""
    return u ^ (top | ((np.uint64(0) - (u >> np.uint64(63 - _lz(top)))) & mask))


@njit(inline="always")
def _from_ordered(v, top, mask):
    """Inverse of _to_ordered: top bit set -> v ^ top, else v ^ mask."""
    return v ^ (top | (((v >> np.uint64(63 - _lz(top))) - np.uint64(1)) & mask))


@njit(inline="always")
def _lz(x):
    return int(leading_zeros(x))


@njit(cache=True, nogil=True)
def _symbols(base, fine, bits, syms, raw):
    """Pass 1 of encoding: symbols into syms, raw bits packed LSB-first into raw; -> (words, counts)."""
    top = np.uint64(1) << np.uint64(bits - 1)
    mask = (top << np.uint64(1)) - np.uint64(1)
    one = np.uint64(1)
    counts = np.zeros(2 * bits + 1, np.int64)
    acc = np.uint64(0)
    nacc = np.uint64(0)
    wp = 0
    for i in range(fine.size):
        p = np.int64(_to_ordered(np.uint64(base[i]), top, mask))
        r = np.int64(_to_ordered(np.uint64(fine[i]), top, mask))
        diff = r - p
        neg = np.int64(diff < 0)
        d = np.uint64(diff * (1 - 2 * neg))  # |r - p|
        k = 63 - _lz(d)  # -1 when d == 0
        s = bits + (k + 1) * (1 - 2 * neg)
        kb = np.uint64(k + np.int64(d == np.uint64(0)))  # raw bits: k, or 0 when equal
        acc |= ((d ^ (one << kb)) & ((one << kb) - one)) << nacc
        nacc += kb
        if nacc >= np.uint64(32):
            raw[wp] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            wp += 1
            acc >>= np.uint64(32)
            nacc -= np.uint64(32)
        syms[i] = s
        counts[s] += 1
    if nacc > np.uint64(0):
        raw[wp] = np.uint32(acc)
        wp += 1
    return wp, counts


@njit(inline="always")
def _element(s, pos, raw, last_word, raw_bits, lead, sign, b, top, mask):
    """Symbol s, its raw bits at bit position pos, and the base element b -> (ordered value, new pos)."""
    kb = raw_bits[s]
    j = np.int64(pos >> np.uint64(5))
    w = np.uint64(raw[min(j, last_word)]) | (np.uint64(raw[min(j + 1, last_word)]) << np.uint64(32))
    ld = lead[s]
    d = ((w >> (pos & np.uint64(31))) & (ld - np.uint64(1))) | ld
    return np.int64(_to_ordered(np.uint64(b), top, mask)) + sign[s] * np.int64(d), pos + kb


@njit(cache=True, nogil=True)
def _decode_chunk(words, freqs, cum, table, scale_bits, base, raw, bits, out):
    """rANS symbols (two interleaved states) + raw bits + base -> fine-tuned bits in out, in one pass (no
    symbol buffer; the two states' dependency chains overlap the reconstruction); -> status code."""
    one = np.uint64(1)
    top = one << np.uint64(bits - 1)
    mask = (top << one) - one
    # Per symbol: raw bit count, the leading one of |d|, and the direction (+1, 0, -1).
    n_sym = 2 * bits + 1
    raw_bits = np.zeros(n_sym, np.uint64)
    lead = np.zeros(n_sym, np.uint64)
    sign = np.zeros(n_sym, np.int64)
    for s in range(n_sym):
        if s != bits:
            k = abs(s - bits) - 1
            raw_bits[s] = k
            lead[s] = one << np.uint64(k)
            sign[s] = 1 if s > bits else -1
    nw = words.size
    if nw < 4:
        return entropy.ERR_TRUNCATED
    n_raw = raw.size
    raw_bits_total = np.uint64(n_raw) * np.uint64(32)
    if n_raw == 0:
        raw = np.zeros(1, np.uint32)  # read (harmlessly) by symbols that need raw bits; caught below
    last_word = raw.size - 1
    sb = np.uint64(scale_bits)
    slot_mask = (one << sb) - one
    x0 = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(32))
    x1 = np.uint64(words[2]) | (np.uint64(words[3]) << np.uint64(32))
    ptr = np.int64(4)
    pos = np.uint64(0)
    n = out.size
    seen = np.uint64(0)  # OR of every reconstructed value: any above mask means a corrupt stream
    for i in range(0, n - 1, 2):
        s0, x0, ptr = entropy.rans_step(x0, words, ptr, nw, freqs, cum, table, sb, slot_mask)
        s1, x1, ptr = entropy.rans_step(x1, words, ptr, nw, freqs, cum, table, sb, slot_mask)
        r0, pos = _element(s0, pos, raw, last_word, raw_bits, lead, sign, base[i], top, mask)
        r1, pos = _element(s1, pos, raw, last_word, raw_bits, lead, sign, base[i + 1], top, mask)
        seen |= np.uint64(r0) | np.uint64(r1)
        out[i] = _from_ordered(np.uint64(r0), top, mask)
        out[i + 1] = _from_ordered(np.uint64(r1), top, mask)
    if n & 1:
        s0, x0, ptr = entropy.rans_step(x0, words, ptr, nw, freqs, cum, table, sb, slot_mask)
        r0, pos = _element(s0, pos, raw, last_word, raw_bits, lead, sign, base[n - 1], top, mask)
        seen |= np.uint64(r0)
        out[n - 1] = _from_ordered(np.uint64(r0), top, mask)
    if ptr > nw or pos > raw_bits_total:
        return entropy.ERR_TRUNCATED
    if seen > mask:  # a value below zero wraps above mask too
        return entropy.ERR_CORRUPT
    used = (pos + np.uint64(31)) >> np.uint64(5)
    spare = pos & np.uint64(31)
    if (x0 != entropy.RANS_L or x1 != entropy.RANS_L or ptr != nw or used != np.uint64(n_raw)
            or (spare != 0 and (np.uint64(raw[last_word]) >> spare) != 0)):
        return entropy.ERR_TRAILING
    return entropy.OK


@dataclass(frozen=True)
class Chunk:
    """One independent piece of a coded tensor: its rANS words and its raw-bit words."""

    n_elems: int
    words: np.ndarray  # uint32 rANS stream
    raw: np.ndarray  # uint32 raw bits


@dataclass(frozen=True)
class CodedDelta:
    bits: int
    counts: np.ndarray  # int64 symbol histogram of the whole tensor
    freqs: np.ndarray  # uint32 normalised model, sums to 2^SCALE_BITS
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        """Payload bytes (the model is stored in the file header)."""
        return sum(4 * (c.words.size + c.raw.size) for c in self.chunks)

    @property
    def raw_bits(self) -> int:
        """Raw bits actually needed: sum of k over elements (padding excluded)."""
        b = self.bits
        k = np.abs(np.arange(2 * b + 1) - b) - 1
        return int((self.counts * np.maximum(k, 0)).sum())

    def order0_bytes(self) -> float:
        """The order-0 bound of the symbol stream plus the raw bits, in bytes."""
        return (entropy.order0_bits(self.counts) + self.raw_bits) / 8


Mapper = Callable[[Callable, Sequence], list]


def _serial_map(fn: Callable, items: Sequence) -> list:
    return [fn(x) for x in items]


def pool_map(workers: int) -> Mapper:
    """A map over threads: every numba function here releases the GIL."""
    if workers <= 1:
        return _serial_map

    def run(fn: Callable, items: Sequence) -> list:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, items))

    return run


def map_tensors(names: Sequence[str], is_big: Callable[[str], bool], fn: Callable[[str, Mapper], object],
                workers: int) -> dict:
    """fn(name, map_fn) for every name, on one pool of `workers` threads: small tensors are single jobs; big
    tensors spread their chunks over the same pool, queued behind the small jobs, so no core idles between
    phases. -> {name: result} in the order of names."""
    if workers <= 1:
        return {n: fn(n, _serial_map) for n in names}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {n: pool.submit(fn, n, _serial_map) for n in names if not is_big(n)}
        out = {n: fn(n, lambda f, items: list(pool.map(f, items))) for n in names if is_big(n)}
        out.update({n: f.result() for n, f in futures.items()})
    return {n: out[n] for n in names}


def _spans(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk_elems, n)) for i in range(0, n, chunk_elems)]


def encode_delta(base: np.ndarray, fine: np.ndarray, chunk_elems: int = CHUNK_ELEMS,
                 map_fn: Mapper = _serial_map) -> CodedDelta:
    """Code fine against base; both are flat arrays of the same unsigned dtype (the float's bit view)."""
    if base.dtype != fine.dtype or base.shape != fine.shape or fine.ndim != 1:
        raise ValueError(f"base {base.dtype}{base.shape} and fine-tune {fine.dtype}{fine.shape} differ")
    bits = DELTA_BITS[fine.dtype]

    def pass1(span):
        lo, hi = span
        syms = np.empty(hi - lo, np.uint8)
        raw = np.empty(((hi - lo) * (bits - 1)) // 32 + 2, np.uint32)
        n_raw, counts = _symbols(base[lo:hi], fine[lo:hi], bits, syms, raw)
        return syms, raw[:n_raw].copy(), counts

    spans = _spans(fine.size, chunk_elems)
    firsts = map_fn(pass1, spans)
    counts = np.sum([c for _, _, c in firsts], axis=0) if firsts else np.zeros(alphabet_size(bits), np.int64)
    freqs = entropy.normalize_counts(counts) if fine.size else np.zeros(alphabet_size(bits), np.uint32)
    enc = entropy.encoder_tables(freqs)

    def pass2(first):
        syms, raw, _ = first
        return Chunk(syms.size, entropy.rans_encode(syms, enc), raw)

    return CodedDelta(bits, counts, freqs, map_fn(pass2, firsts))


def decode_delta(base: np.ndarray, freqs: np.ndarray, chunks: Sequence[Chunk], out: np.ndarray,
                 map_fn: Mapper = _serial_map) -> int:
    """Rebuild the fine-tuned bits into out (flat, base's dtype); -> entropy.OK or the first error code."""
    bits = DELTA_BITS[out.dtype]
    cum = entropy.cumulative(freqs)
    table = entropy.decode_table(freqs, entropy.SCALE_BITS)
    starts = np.cumsum([0] + [c.n_elems for c in chunks])

    def one(i):
        lo, hi = int(starts[i]), int(starts[i + 1])
        return _decode_chunk(chunks[i].words, freqs, cum, table, entropy.SCALE_BITS, base[lo:hi], chunks[i].raw,
                             bits, out[lo:hi])

    return max(map_fn(one, range(len(chunks))), default=entropy.OK)
