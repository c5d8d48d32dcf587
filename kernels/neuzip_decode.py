"""NeuZip decode: a bf16 weight from its rANS-coded exponents and its raw sign and top mantissa bits.

Stream layout (serve/codecs/neuzip.py writes it): a tensor's n exponents are split over L = ceil(n / LANE)
lanes, element i in lane i % L at step i // L, so at every step the lanes write L consecutive outputs
(coalesced on a GPU, sequential on a CPU). Each lane is an independent rANS stream of 16-bit words:
32-bit state x in [2^16, 2^32), 12-bit model, the lane's final encoder state first (low word, high word).
One decode step:

    t = table[x & 0xFFF]                    # sym | (freq - 1) << 8 | (slot - cum[sym]) << 20
    x = ((t >> 8 & 0xFFF) + 1) * (x >> 12) + (t >> 20 & 0xFFF)
    if x < 2^16: x = x << 16 | next word

The sign and k kept mantissa bits are a (k+1)-bit field per element, packed LSB-first into bytes
(k in {0, 1, 3, 7}: 8, 4, 2 or 1 fields a byte). The output is sign << 15 | e << 7 | m << (7 - k).

A lane must read exactly its own words and end in state 2^16; any other end (a corrupt or truncated stream)
sets its status to 1. Reads are clamped to the words array, so a bad stream yields garbage, never a fault.

Three forms with one signature, (words, offsets, table, sm, bits, out) -> status:
- neuzip_decode_torch: the specification, vectorised over lanes (a Python loop over steps).
- neuzip_decode_numba: what CPU serving runs (kernels/neuzip_decode_cpu.py: nogil, threads split the lanes).
- neuzip_decode_triton: one program per block of lanes.
words int16 [W] (16-bit words), offsets int64 [L + 1], table int32 [4096], sm uint8, out int16 [n] (a bf16
tensor's bits) written in place; status int32 [L], 0 where the lane decoded cleanly.

A GPU server decodes several tensors a launch instead: kernels/neuzip_groups.py, over the same lane steps.
"""

import torch

from kernels._backend import tl, triton

SCALE_BITS = 12
RANS_L = 1 << 16
SLOT_MASK = (1 << SCALE_BITS) - 1
BLOCK_LANES = 128


def check_stream(words: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, sm: torch.Tensor, bits: int,
           out: torch.Tensor) -> None:
    if bits not in (0, 1, 3, 7):
        raise ValueError(f"bits must be 0, 1, 3 or 7; got {bits}")
    if words.dtype != torch.int16 or out.dtype != torch.int16 or sm.dtype != torch.uint8:
        raise TypeError("words and out must be int16, sm uint8")
    if offsets.dtype != torch.int64 or table.dtype != torch.int32 or table.numel() != 1 << SCALE_BITS:
        raise TypeError("offsets must be int64, table int32 of 4096 entries")
    if offsets.numel() < 2 or out.numel() == 0:
        raise ValueError("a stream needs at least one lane and one element")
    if sm.numel() < -(-out.numel() * (bits + 1) // 8):
        raise ValueError(f"sm has {sm.numel()} bytes; {out.numel()} elements of {bits + 1} bits need more")


def log_fields_per_byte(bits: int) -> int:
    """log2 of the (bits + 1)-bit fields in a byte: 3, 2, 1, 0 for bits 0, 1, 3, 7."""
    return 4 - (bits + 1).bit_length()


def lanes_for(n: int, lane: int) -> int:
    """Lanes of a tensor of n elements with at most `lane` symbols each."""
    return -(-n // lane)


def neuzip_decode_torch(words: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, sm: torch.Tensor,
                        bits: int, out: torch.Tensor) -> torch.Tensor:
    """The specification: every lane one step at a time, lanes in parallel."""
    check_stream(words, offsets, table, sm, bits, out)
    n, lanes = out.numel(), offsets.numel() - 1
    w = words.long() & 0xFFFF
    last = max(w.numel() - 1, 0)
    start, end = offsets[:-1], offsets[1:]
    if w.numel() == 0:
        w = torch.zeros(1, dtype=torch.long, device=words.device)
    x = w[start.clamp(max=last)] | (w[(start + 1).clamp(max=last)] << 16)
    bad = end - start < 2
    ptr = start + 2
    t_all = table.long() & 0xFFFFFFFF
    exps = torch.empty(n, dtype=torch.long, device=out.device)
    for j in range(-(-n // lanes)):
        a = min(lanes, n - j * lanes)  # lanes that still have a symbol at this step: always a prefix
        t = t_all[x[:a] & SLOT_MASK]
        xs = (((t >> 8) & 0xFFF) + 1) * (x[:a] >> SCALE_BITS) + ((t >> 20) & 0xFFF)
        need = xs < RANS_L
        xs = torch.where(need, (xs << 16) | w[ptr[:a].clamp(max=last)], xs)
        x[:a] = xs
        ptr[:a] += need
        exps[j * lanes: j * lanes + a] = t & 0xFF
    bad |= (ptr != end) | (x != RANS_L)
    field = unpack_fields(sm, bits + 1, n)
    value = ((field >> bits) << 15) | (exps << 7) | ((field & ((1 << bits) - 1)) << (7 - bits))
    out.copy_((value - ((value >> 15) << 16)).to(torch.int16))  # as signed 16-bit
    return bad.to(torch.int32)


def unpack_fields(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """n fields of `width` bits (1, 2, 4 or 8), LSB-first in each byte -> int64 [n]."""
    per = 8 // width
    shifts = torch.arange(per, device=packed.device) * width
    fields = (packed[: -(-n // per)].long()[:, None] >> shifts) & ((1 << width) - 1)
    return fields.reshape(-1)[:n]


@triton.jit
def decode_lanes_block(words_ptr, offsets_ptr, table_ptr, sm_ptr, out_ptr, lane, n, lanes, n_words, BITS: tl.constexpr,
                       LOG_PER: tl.constexpr):
    """The block of lanes `lane` (those < lanes live) of one tensor, every step; at step j each lane writes
    output j * lanes + lane. -> whether each lane decoded cleanly."""
    live = lane < lanes
    start = tl.load(offsets_ptr + lane, mask=live, other=0)
    end = tl.load(offsets_ptr + lane + 1, mask=live, other=0)
    last = tl.maximum(n_words - 1, 0)
    w0 = tl.load(words_ptr + tl.minimum(start, last), mask=live, other=0).to(tl.int64) & 0xFFFF
    w1 = tl.load(words_ptr + tl.minimum(start + 1, last), mask=live, other=0).to(tl.int64) & 0xFFFF
    x = w0 | (w1 << 16)
    ptr = start + 2
    for j in range(0, (n + lanes - 1) // lanes):
        i = j * lanes + lane
        act = live & (i < n)
        t = tl.load(table_ptr + (x & 0xFFF), mask=act, other=0).to(tl.int64) & 0xFFFFFFFF
        xs = (((t >> 8) & 0xFFF) + 1) * (x >> 12) + ((t >> 20) & 0xFFF)
        need = act & (xs < 65536)
        w = tl.load(words_ptr + tl.minimum(ptr, last), mask=need, other=0).to(tl.int64) & 0xFFFF
        xs = tl.where(need, (xs << 16) | w, xs)
        x = tl.where(act, xs, x)
        ptr = ptr + need.to(tl.int64)
        byte = tl.load(sm_ptr + (i >> LOG_PER), mask=act, other=0).to(tl.int64) & 0xFF
        f = (byte >> ((i & ((1 << LOG_PER) - 1)) * (BITS + 1))) & ((1 << (BITS + 1)) - 1)
        v = ((f >> BITS) << 15) | ((t & 0xFF) << 7) | ((f & ((1 << BITS) - 1)) << (7 - BITS))
        tl.store(out_ptr + i, (v - ((v >> 15) << 16)).to(tl.int16), mask=act)
    return (ptr == end) & (x == 65536) & (end - start >= 2)


@triton.jit
def _neuzip_decode_kernel(words_ptr, offsets_ptr, table_ptr, sm_ptr, out_ptr, status_ptr, n, lanes, n_words,
                          BITS: tl.constexpr, LOG_PER: tl.constexpr, BLOCK: tl.constexpr):
    """One program: BLOCK lanes of the tensor."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = decode_lanes_block(words_ptr, offsets_ptr, table_ptr, sm_ptr, out_ptr, lane, n, lanes, n_words, BITS,
                             LOG_PER)
    tl.store(status_ptr + lane, tl.where(ok, 0, 1).to(tl.int32), mask=lane < lanes)


def neuzip_decode_triton(words: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, sm: torch.Tensor,
                         bits: int, out: torch.Tensor) -> torch.Tensor:
    check_stream(words, offsets, table, sm, bits, out)
    n, lanes = out.numel(), offsets.numel() - 1
    status = torch.empty(lanes, dtype=torch.int32, device=out.device)
    log_per = log_fields_per_byte(bits)
    grid = (triton.cdiv(lanes, BLOCK_LANES),)
    _neuzip_decode_kernel[grid](words, offsets, table, sm, out, status, n, lanes, words.numel(), BITS=bits,
                                LOG_PER=log_per, BLOCK=BLOCK_LANES)
    return status
