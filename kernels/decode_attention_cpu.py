"""Decode attention on the CPU: what a CPU server runs for fp32 caches (decode_attention_numba, beside its torch
reference kernels/decode_attention.py: decode_attention_torch, with the same signature and semantics).

It reads each row's keys and values where its blocks lie, as the Triton kernel does, in one compiled loop over
the rows split over the cores, an online softmax over STEP positions at a time. The twin gathers the rows'
blocks into one copy first and then runs SDPA: at 64 rows of 512 positions of SmolLM2's heads over a 2 GB cache,
29 ms a layer against this loop's 7 (2-core CPU), the copy costing more than the attention.
STEP does not depend on the block size, so a row's output is the same, bit for bit, in blocks of 16 and in one
block of its whole context; it sums in another order than the twin (equal up to fp32 rounding).
"""

import math

import numpy as np
import torch
from numba import njit, prange

from kernels.decode_attention import _check

STEP = 16
"""Positions an online-softmax step takes (any block size: a step may span blocks)."""
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)


@njit(inline="always", fastmath=True, error_model="numpy")
def _exp_nonpositive(s: np.ndarray, bits: np.ndarray, count: int) -> None:
    """s[:count] <- exp(s[:count]) for s <= 0 (Cephes' expf: 2^n times a polynomial of the rest), in loops that
    LLVM vectorises; math.exp is a libm call per value, which it cannot (with it and a division a position, the
    loop took 13% longer here).
    Below -87 it is exp(-87) rather than 0, which weighs nothing beside the largest score's exp(0)."""
    for i in range(count):
        x = max(s[i], np.float32(-87.0))
        n = np.float32(math.floor(x * LOG2E + np.float32(0.5)))
        r = x - n * LN2_HI - n * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        s[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(count):
        s[i] *= scale[i]


@njit(inline="always", fastmath=True, error_model="numpy")
def _softmax_step(weights: np.ndarray, count: int, most: np.ndarray, total: np.ndarray, acc: np.ndarray, h: int,
                  bits: np.ndarray) -> None:
    """Head h's online softmax over its next `count` scores (weights, which become their exp(score - max)): its
    running max, the sum of its weights and its output so far (acc) rescaled to the new max."""
    m = most[h]
    for i in range(count):
        m = max(m, weights[i])
    shrink = np.float32(math.exp(most[h] - m)) if most[h] > -np.inf else np.float32(0.0)
    most[h] = m
    total[h] *= shrink
    for d in range(acc.shape[0]):
        acc[d] *= shrink
    for i in range(count):
        weights[i] -= m
    _exp_nonpositive(weights, bits, count)
    for i in range(count):
        total[h] += weights[i]


@njit(parallel=True, fastmath=True, nogil=True, cache=True, error_model="numpy")
def _decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, lengths: np.ndarray, scale: float,
            out: np.ndarray) -> None:
    """q [B, H, D], k, v [NB, BT, KVH, D], tables [R, W], lengths [B] -> out [B, H, D]: a row is a task, which
    reads each position's keys (then values) of all its heads together, one contiguous run, for every query head
    (its key/value head: h // (H / KVH)). The loop is bound by arithmetic on this CPU, not by memory: one task a
    row, rather than one a (row, key/value head), reads each key once, and the block and offset of each position
    are stepped, not divided."""
    rows, heads, dim = q.shape
    block = k.shape[1]
    group = heads // k.shape[2]
    for b in prange(rows):
        n = lengths[b]
        acc = np.zeros((heads, dim), dtype=np.float32)
        if n > 0:
            qs = np.empty((heads, dim), dtype=np.float32)
            for h in range(heads):
                for d in range(dim):
                    qs[h, d] = q[b, h, d] * np.float32(scale)
            most = np.full(heads, -np.inf, dtype=np.float32)
            total = np.zeros(heads, dtype=np.float32)
            s = np.empty((heads, STEP), dtype=np.float32)
            bits = np.empty(STEP, dtype=np.int32)
            blocks = np.empty(STEP, dtype=np.int64)
            offsets = np.empty(STEP, dtype=np.int64)
            entry, at = 0, 0
            for start in range(0, n, STEP):
                count = min(STEP, n - start)
                for i in range(count):
                    blocks[i], offsets[i] = tables[b, entry], at
                    at += 1
                    if at == block:
                        entry, at = entry + 1, 0
                for i in range(count):
                    keys = k[blocks[i], offsets[i]]
                    for h in range(heads):
                        key = keys[h // group]
                        a = np.float32(0.0)
                        for d in range(dim):
                            a += qs[h, d] * key[d]
                        s[h, i] = a
                for h in range(heads):
                    _softmax_step(s[h], count, most, total, acc[h], h, bits)
                for i in range(count):
                    values = v[blocks[i], offsets[i]]
                    for h in range(heads):
                        value = values[h // group]
                        w = s[h, i]
                        for d in range(dim):
                            acc[h, d] += w * value[d]
            for h in range(heads):
                inv = np.float32(1.0) / total[h]
                for d in range(dim):
                    acc[h, d] *= inv
        for h in range(heads):
            for d in range(dim):
                out[b, h, d] = acc[h, d]


def decode_attention_numba(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float, max_length: int
                           ) -> torch.Tensor:
    """CPU serving's form for fp32 caches: the twin's contract, checked the same way; max_length is not read (each
    row stops at its own length). -> a new [B, H, D]."""
    _check(q, k_cache, v_cache, block_tables, lengths)
    if q.dtype != torch.float32 or q.is_cuda:
        raise ValueError(f"decode_attention_numba: expected fp32 CPU tensors; got {q.dtype} on {q.device}")
    o = torch.empty_like(q)
    if q.shape[0]:
        _decode(q.numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(), lengths.numpy(), float(scale),
                o.numpy())
    return o
