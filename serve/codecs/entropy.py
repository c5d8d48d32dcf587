"""Static order-0 rANS, JIT-compiled with numba: the entropy coder under FM-Delta (and NeuZip later).

One stream is coded in two passes: count its symbols, normalise the counts to a power-of-two total
(stored beside the stream), then code every symbol against that fixed model. The coder is ryg's rans64:
a 64-bit state, 32-bit output words, L = 2^31. Encoding runs from the last symbol to the first so that
decoding reads forward. Every function here is `nogil`, so streams code in parallel on threads.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

SCALE_BITS = 16
"""Model precision: frequencies sum to 2^16, so the decode table is 64 KiB and stays in L2."""
RANS_L = np.uint64(1 << 31)
_MASK32 = np.uint64(0xFFFFFFFF)

# Decoder status codes; 0 is success. The Python layer turns them into one-line errors.
OK = 0
ERR_TRUNCATED = 1
ERR_CORRUPT = 2
ERR_TRAILING = 3
STATUS_TEXT = {
    ERR_TRUNCATED: "stream ends early",
    ERR_CORRUPT: "stream decodes to an impossible value",
    ERR_TRAILING: "stream does not end where its header says",
}


def normalize_counts(counts: np.ndarray, scale_bits: int = SCALE_BITS) -> np.ndarray:
    """Scale counts to frequencies summing to 2^scale_bits, keeping every present symbol >= 1.

    Largest-remainder rounding; the cost over the order-0 bound is far below 0.1% for our streams.
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total <= 0:
        raise ValueError("cannot normalise an empty histogram")
    target = 1 << scale_bits
    if int((counts > 0).sum()) > target:
        raise ValueError(f"{int((counts > 0).sum())} symbols do not fit a 2^{scale_bits} model")
    exact = counts.astype(np.float64) * target / total
    freqs = np.floor(exact).astype(np.int64)
    freqs[(counts > 0) & (freqs == 0)] = 1
    diff = target - int(freqs.sum())
    if diff > 0:
        # Hand the remainder to the symbols that lost the most to flooring.
        order = np.argsort(-(exact - np.floor(exact)), kind="stable")
        freqs[order[:diff]] += 1
    while diff < 0:  # at most one pass per symbol: each takes all it can
        s = int(np.argmax(freqs))
        take = min(-diff, int(freqs[s]) - 1)
        freqs[s] -= take
        diff += take
    return freqs.astype(np.uint32)


def order0_bits(counts: np.ndarray) -> float:
    """The order-0 entropy bound of a stream with these symbol counts, in bits."""
    counts = np.asarray(counts, dtype=np.float64)
    counts = counts[counts > 0]
    total = counts.sum()
    if total == 0:
        return 0.0
    return float(-(counts * np.log2(counts / total)).sum())


@njit(cache=True, nogil=True)
def cumulative(freqs: np.ndarray) -> np.ndarray:
    cum = np.zeros(freqs.size + 1, np.uint32)
    for i in range(freqs.size):
        cum[i + 1] = cum[i] + freqs[i]
    return cum


@njit(cache=True, nogil=True)
def decode_table(freqs: np.ndarray, scale_bits: int) -> np.ndarray:
    """slot -> symbol for every slot of the 2^scale_bits range."""
    table = np.zeros(1 << scale_bits, np.uint8)
    start = 0
    for s in range(freqs.size):
        f = int(freqs[s])
        table[start : start + f] = s
        start += f
    return table


@intrinsic
def _mulhi64(typingctx, a, b):
    """High 64 bits of the 128-bit product a * b (both uint64)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i128 = ir.IntType(128)
        prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        return builder.trunc(builder.lshr(prod, ir.Constant(i128, 64)), ir.IntType(64))

    return sig, codegen


def encoder_tables(freqs: np.ndarray, scale_bits: int = SCALE_BITS) -> np.ndarray:
    """Per symbol (rcp_freq, rcp_shift, bias, cmpl_freq, x_max) for division-free encoding.

    ryg's rans64 (after Alverson, "Integer division using reciprocals"): x // f == mulhi(x, rcp) >> shift
    for every state x < 2^63, so encoding replaces a 64-bit division with one wide multiply.
    """
    cum = np.concatenate([[0], np.cumsum(freqs.astype(np.int64))])
    table = np.zeros((freqs.size, 5), np.uint64)
    for s, f in enumerate(int(v) for v in freqs):
        if f == 0:
            continue
        if f == 1:
            rcp, shift, bias = (1 << 64) - 1, 0, int(cum[s]) + (1 << scale_bits) - 1
        else:
            shift = (f - 1).bit_length()  # smallest shift with f <= 2^shift
            x1 = 1 << (shift + 31)
            t1, rem = divmod(x1, f)
            t0 = (f - 1 + (rem << 32)) // f
            rcp, shift, bias = (t0 + (t1 << 32)) & ((1 << 64) - 1), shift - 1, int(cum[s])
        x_max = ((int(RANS_L) >> scale_bits) << 32) * f
        table[s] = (rcp, shift, bias, (1 << scale_bits) - f, x_max)
    return table


@njit(cache=True, nogil=True)
def rans_encode(syms: np.ndarray, enc: np.ndarray) -> np.ndarray:
    """Code syms (uint8) into 32-bit words with two interleaved states (even / odd positions).

    enc comes from encoder_tables. Two states break the decoder's serial dependency chain. At most one
    word leaves per symbol, so n + 4 words suffice.
    """
    n = syms.size
    out = np.empty(n + 4, np.uint32)
    ptr = n + 4
    x0 = RANS_L
    x1 = RANS_L
    for i in range(n - 1, -1, -1):
        s = syms[i]
        x = x1 if i & 1 else x0
        if x >= enc[s, 4]:
            ptr -= 1
            out[ptr] = np.uint32(x & _MASK32)
            x >>= np.uint64(32)
        q = _mulhi64(x, enc[s, 0]) >> enc[s, 1]
        x = x + enc[s, 2] + q * enc[s, 3]
        if i & 1:
            x1 = x
        else:
            x0 = x
    for x in (x1, x0):  # the decoder reads x0 first
        ptr -= 2
        out[ptr] = np.uint32(x & _MASK32)
        out[ptr + 1] = np.uint32(x >> np.uint64(32))
    return out[ptr:].copy()


@njit(inline="always")
def rans_step(x, words, ptr, nw, freqs, cum, table, sb, slot_mask):
    """One decode step of state x -> (symbol, state, read position). Renormalisation is branch-free and the read
    index clamped: a truncated stream reads garbage, never out of bounds, and ptr > nw tells the caller."""
    slot = x & slot_mask
    s = table[slot]
    x = np.uint64(freqs[s]) * (x >> sb) + slot - np.uint64(cum[s])
    need = x < RANS_L
    w = np.uint64(words[min(ptr, nw - 1)])
    x = ((x << np.uint64(32)) | w) if need else x
    return s, x, ptr + np.int64(need)


@njit(cache=True, nogil=True)
def rans_decode(words: np.ndarray, freqs: np.ndarray, cum: np.ndarray, table: np.ndarray,
                scale_bits: int, out: np.ndarray) -> int:
    """Decode out.size symbols into out; returns a status code (OK on success)."""
    nw = words.size
    if nw < 4:
        return ERR_TRUNCATED
    sb = np.uint64(scale_bits)
    slot_mask = (np.uint64(1) << sb) - np.uint64(1)
    x0 = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(32))
    x1 = np.uint64(words[2]) | (np.uint64(words[3]) << np.uint64(32))
    ptr = np.int64(4)
    n = out.size
    for i in range(0, n - 1, 2):
        out[i], x0, ptr = rans_step(x0, words, ptr, nw, freqs, cum, table, sb, slot_mask)
        out[i + 1], x1, ptr = rans_step(x1, words, ptr, nw, freqs, cum, table, sb, slot_mask)
    if n & 1:
        out[n - 1], x0, ptr = rans_step(x0, words, ptr, nw, freqs, cum, table, sb, slot_mask)
    if ptr > nw:
        return ERR_TRUNCATED
    if x0 != RANS_L or x1 != RANS_L or ptr != nw:
        return ERR_TRAILING
    return OK
