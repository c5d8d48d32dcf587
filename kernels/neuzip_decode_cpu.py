"""NeuZip decode on the CPU: what a CPU server runs (neuzip_decode_numba, beside its torch reference
kernels/neuzip_decode.py: neuzip_decode_torch, with the same signature and stream layout), and the pieces the
engine's layer-ahead decoder (serve/engine/neuzip/decoder.py) drives itself: the compiled one-thread decoder of
a range of lanes, the lanes' split over threads and the thread pool.

Numba compiles the lane loop with nogil, so threads split the lanes; 16 lanes take one vector step together
(a block step written in LLVM IR, one AVX-512 register of states), with a scalar loop for what is left.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.neuzip_decode import RANS_L, SCALE_BITS, SLOT_MASK, check_stream, log_fields_per_byte


@njit(nogil=True, cache=True, inline="always")
def _lane_step(x: np.ndarray, ptr: np.ndarray, k, table: np.ndarray, words: np.ndarray, last) -> np.uint8:
    """One rANS step of lane k (state x[k], next word ptr[k], read clamped to `last`): its symbol."""
    xs = x[k]
    t = table[xs & np.uint32(SLOT_MASK)]
    xs = (((t >> np.uint32(8)) & np.uint32(0xFFF)) + np.uint32(1)) * (xs >> np.uint32(SCALE_BITS)) \
        + (t >> np.uint32(20))
    p = ptr[k]
    w = np.uint32(words[min(p, last)])
    need = xs < np.uint32(RANS_L)
    x[k] = ((xs << np.uint32(16)) | w) if need else xs
    ptr[k] = p + ptr.dtype.type(need)
    return np.uint8(t & np.uint32(0xFF))


@njit(nogil=True, cache=True)
def _lane_status(x: np.ndarray, ptr: np.ndarray, offsets: np.ndarray, lo: int, hi: int, status: np.ndarray) -> None:
    """0 for each lane of [lo, hi) that read exactly its own words and ended in the initial state, else 1."""
    for l in range(lo, hi):
        ok = np.int64(ptr[l - lo]) == offsets[l + 1] and x[l - lo] == RANS_L and offsets[l + 1] - offsets[l] >= 2
        status[l] = 0 if ok else 1


@njit(nogil=True, cache=True)
def _exponents_scalar(words: np.ndarray, offsets: np.ndarray, table: np.ndarray, exps: np.ndarray, lo: int,
                      hi: int, status: np.ndarray) -> None:
    """The rANS pass for lanes [lo, hi), step by step, one lane at a time: any stream (reads clamped), any size.
    The inner loop over lanes has no dependency between iterations, so the CPU overlaps several lanes' table
    reads. Unsigned indices: numba then skips the negative-index wrap-around on every access (a fifth of the
    time)."""
    n = exps.size
    lanes = offsets.size - 1
    if words.size == 0:
        status[lo:hi] = 1
        return
    last = np.uint64(words.size - 1)
    x = np.empty(hi - lo, np.uint32)
    ptr = np.empty(hi - lo, np.uint64)
    for l in range(lo, hi):
        s = np.uint64(offsets[l])
        x[l - lo] = np.uint32(words[min(s, last)]) | (np.uint32(words[min(s + np.uint64(1), last)]) << np.uint32(16))
        ptr[l - lo] = s + np.uint64(2)
    for j in range((n + lanes - 1) // lanes):
        base = np.uint64(j * lanes)
        for ul in range(np.uint64(lo), np.uint64(min(hi, n - j * lanes))):
            exps[base + ul] = _lane_step(x, ptr, ul - np.uint64(lo), table, words, last)
    _lane_status(x, ptr, offsets, lo, hi, status)


VEC = 16  # lanes of a vector block: 16 32-bit states, one AVX-512 register
GROUP = 4  # blocks that run through every step together (see _exponents_vector)
_V32 = ir.VectorType(ir.IntType(32), VEC)


def _splat(value: int) -> ir.Constant:
    """The constant vector of `value` in every lane."""
    return ir.Constant(_V32, [value] * VEC)


def _broadcast(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """A run-time integer, as 32 bits, in every lane."""
    one = builder.insert_element(ir.Constant(_V32, None), builder.trunc(value, ir.IntType(32)),
                                 ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(_V32, None), ir.Constant(_V32, [0] * VEC))


def _gather(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, align: int) -> ir.Value:
    """16 32-bit loads, lane i from base[index[i]] (base's element size scales the index): one vpgatherdd.
    llvmlite's GEP has no vector indices, so its result type is set by hand."""
    address = builder.gep(base, [index], source_etype=base.type.pointee)
    address.type = ir.VectorType(ir.IntType(32).as_pointer(), VEC)
    mask_type = ir.VectorType(ir.IntType(1), VEC)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32, [address.type, ir.IntType(32),
                                        mask_type, _V32]), "llvm.masked.gather.v16i32.v16p0")
    return builder.call(fn, [address, ir.Constant(ir.IntType(32), align), ir.Constant(mask_type, [1] * VEC),
                             ir.Constant(_V32, None)])


def _block_step_ir(context, builder: ir.IRBuilder, sig, args) -> ir.Value:
    """_block_step's code: the scalar step on 16 lanes at once. The renormalisation word is read for every lane
    (a select keeps it where x >= 2^16) as the 32-bit word pair at words[p - 1], whose high half is words[p]:
    a 32-bit gather, as there is no 16-bit one, that stays inside the array for 1 <= p <= last. Only the first
    m symbols are stored (a masked store)."""
    x_arr, ptr_arr, k, table, words, last, exps, e, m = args
    xd, pd, td, wd, ed = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 1, 3, 4, 6))
    x_at = builder.bitcast(builder.gep(xd, [k]), _V32.as_pointer())
    p_at = builder.bitcast(builder.gep(pd, [k]), _V32.as_pointer())
    x, p = builder.load(x_at, align=4), builder.load(p_at, align=4)
    t = _gather(builder, td, builder.and_(x, _splat(SLOT_MASK)), 4)
    freq = builder.add(builder.and_(builder.lshr(t, _splat(8)), _splat(0xFFF)), _splat(1))
    xs = builder.add(builder.mul(freq, builder.lshr(x, _splat(SCALE_BITS))), builder.lshr(t, _splat(20)))
    need = builder.icmp_unsigned("<", xs, _splat(RANS_L))
    lastv = _broadcast(builder, last)
    p_read = builder.select(builder.icmp_unsigned("<", p, lastv), p, lastv)
    pair = _gather(builder, wd, builder.sub(p_read, _splat(1)), 2)
    renorm = builder.or_(builder.shl(xs, _splat(16)), builder.lshr(pair, _splat(16)))
    builder.store(builder.select(need, renorm, xs), x_at, align=4)
    builder.store(builder.add(p, builder.zext(need, _V32)), p_at, align=4)
    v8 = ir.VectorType(ir.IntType(8), VEC)
    mask_type = ir.VectorType(ir.IntType(1), VEC)
    live = builder.icmp_unsigned("<", ir.Constant(_V32, list(range(VEC))), _broadcast(builder, m))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [v8, v8.as_pointer(),
                                        ir.IntType(32), mask_type]), "llvm.masked.store.v16i8.p0")
    e_at = builder.bitcast(builder.gep(ed, [e]), v8.as_pointer())
    builder.call(fn, [builder.trunc(t, v8), e_at, ir.Constant(ir.IntType(32), 1), live])
    return context.get_dummy_value()


@intrinsic
def _block_step(typingctx, x, ptr, k, table, words, last, exps, e, m):
    """One step of lanes k..k+15 of the state arrays x and ptr (uint32), their first m symbols to exps[e:e + m]. Written
    in LLVM IR because LLVM does not vectorise the scalar loop: it cannot rule out that the state stores alias
    the gathered table and words. llvm.masked.gather is generic: without AVX-512 LLVM splits or scalarises it."""
    return types.void(x, ptr, k, table, words, last, exps, e, m), _block_step_ir


@njit(nogil=True, cache=True)
def _vector_fits(words: np.ndarray, offsets: np.ndarray, n: int, lo: int, hi: int) -> bool:
    """Whether the 32-bit vector pass decodes lanes [lo, hi) exactly as _exponents_scalar: every start inside the
    words and every pointer (at most a start + 2 + one word per step) below 2^31, so no clamp or wrap differs."""
    size = words.size
    if size < 2 or size + n // (offsets.size - 1) + 4 >= 1 << 31:
        return False
    for l in range(lo, hi):
        if offsets[l] < 0 or offsets[l] > size:
            return False
    return True


@njit(nogil=True, cache=True)
def _exponents_vector(words: np.ndarray, offsets: np.ndarray, table: np.ndarray, exps: np.ndarray, lo: int,
                      hi: int, status: np.ndarray) -> None:
    """The rANS pass for lanes [lo, hi), 16 lanes a vector step (_block_step). The states are padded to whole
    blocks: a padding lane decodes garbage from word 2 on and stores nothing. Up to GROUP blocks at a time (as
    even groups as can be) run through every full step: their 64 lanes' current lines of words and the 16 KB
    table stay in L1, which all lanes' lines do not (a quarter slower). The last, partial step is scalar."""
    n, lanes, size, m = exps.size, offsets.size - 1, words.size, hi - lo
    blocks = (m + VEC - 1) // VEC
    last = np.uint32(size - 1)
    x = np.full(blocks * VEC, RANS_L, np.uint32)
    ptr = np.full(blocks * VEC, 2, np.uint32)
    for l in range(lo, hi):
        s = offsets[l]
        x[l - lo] = np.uint32(words[min(s, size - 1)]) | (np.uint32(words[min(s + 1, size - 1)]) << np.uint32(16))
        ptr[l - lo] = np.uint32(s + 2)
    full = n // lanes
    groups = (blocks + GROUP - 1) // GROUP
    for g in range(groups):
        for j in range(full):
            for b in range(blocks * g // groups, blocks * (g + 1) // groups):
                _block_step(x, ptr, b * VEC, table, words, last, exps, j * lanes + lo + b * VEC, min(VEC, m - b * VEC))
    for l in range(lo, min(hi, n - full * lanes)):
        exps[full * lanes + l] = _lane_step(x, ptr, l - lo, table, words, last)
    _lane_status(x, ptr, offsets, lo, hi, status)


@njit(nogil=True, cache=True)
def _exponents(words: np.ndarray, offsets: np.ndarray, table: np.ndarray, exps: np.ndarray, lo: int, hi: int,
               status: np.ndarray) -> None:
    """The rANS pass for lanes [lo, hi): vectorised where _vector_fits (every stream the encoder writes), else
    lane by lane. Both read and write exactly the same, so a stream decodes alike whichever ran it (a corrupt one
    included)."""
    if _vector_fits(words, offsets, exps.size, lo, hi):
        _exponents_vector(words, offsets, table, exps, lo, hi, status)
    else:
        _exponents_scalar(words, offsets, table, exps, lo, hi, status)


def _make_decode_lanes(bits: int):
    """The rANS pass over lanes [lo, hi), then the pass that joins their exponents with sign and mantissa, the
    field layout baked in as constants. The second pass reads the elements of the same lanes (at step j, the
    run j * lanes + [lo, hi)), so one thread's share of a tensor needs no other thread's: one call a thread."""
    width = bits + 1
    log_per = log_fields_per_byte(bits)
    per_mask = (1 << log_per) - 1
    field_mask = (1 << width) - 1

    @njit(nogil=True)
    def decode_lanes(words: np.ndarray, offsets: np.ndarray, table: np.ndarray, sm: np.ndarray, exps: np.ndarray,
                     out: np.ndarray, lo: int, hi: int, status: np.ndarray) -> None:
        _exponents(words, offsets, table, exps, lo, hi, status)
        n = np.uint64(out.size)
        lanes = np.uint64(offsets.size - 1)
        for j in range((out.size + offsets.size - 2) // (offsets.size - 1)):
            base = np.uint64(j) * lanes
            for i in range(base + np.uint64(lo), min(base + np.uint64(hi), n)):
                shift = np.uint32((i & np.uint64(per_mask)) * np.uint64(width))
                f = (np.uint32(sm[i >> np.uint64(log_per)]) >> shift) & np.uint32(field_mask)
                out[i] = ((f >> np.uint32(bits)) << np.uint32(15)) | (np.uint32(exps[i]) << np.uint32(7)) \
                    | ((f & np.uint32((1 << bits) - 1)) << np.uint32(7 - bits))

    return decode_lanes


_DECODE_LANES = {}


def decode_lanes(bits: int):
    """The compiled one-thread decoder of (bits + 1)-bit fields: (words, offsets, table, sm, exps, out, lo, hi,
    status), numpy arrays (uint16, int64, uint32, uint8, uint8 scratch of n, uint16 out, lanes [lo, hi), int32)."""
    if bits not in _DECODE_LANES:
        _DECODE_LANES[bits] = _make_decode_lanes(bits)
    return _DECODE_LANES[bits]


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="neuzip")
    return _POOL


def lane_cuts(n: int, lanes: int, threads: int) -> list[tuple[int, int]]:
    """Each thread's lanes: `threads` (at most every core and every lane; 1 under 2^16 elements, where handing
    work to another thread costs more than it saves) even shares."""
    threads = max(1, min(threads, lanes, os.cpu_count() or 1))
    if n < (1 << 16):
        threads = 1
    cuts = [lanes * t // threads for t in range(threads + 1)]
    return list(zip(cuts, cuts[1:]))


def run_split(fn, parts: list[tuple]) -> None:
    """fn(*part) for every part: the first on this thread, the rest on the pool (numba releases the GIL)."""
    jobs = [_pool().submit(fn, *part) for part in parts[1:]]
    fn(*parts[0])
    for job in jobs:
        job.result()


def neuzip_decode_numba(words: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, sm: torch.Tensor,
                        bits: int, out: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """CPU serving's form, in two passes per thread (the rANS pass writes exponent bytes, a second pass joins
    them with sign and mantissa: a quarter faster than one pass doing both); `threads` (default: torch's thread
    count, at most every core) split the lanes."""
    check_stream(words, offsets, table, sm, bits, out)
    n, lanes = out.numel(), offsets.numel() - 1
    args = (words.numpy().view(np.uint16), offsets.numpy(), table.numpy().view(np.uint32), sm.numpy(),
            np.empty(n, np.uint8), out.numpy().view(np.uint16))
    status = np.zeros(lanes, np.int32)
    cuts = lane_cuts(n, lanes, threads or torch.get_num_threads())
    run_split(decode_lanes(bits), [(*args, lo, hi, status) for lo, hi in cuts])
    return torch.from_numpy(status)


