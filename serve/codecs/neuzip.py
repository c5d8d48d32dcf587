"""NeuZip (METHODS.md section 2): a bf16 weight as its entropy-coded exponents plus raw sign and mantissa bits.

A bf16 weight is sign (1 bit) | exponent (8) | mantissa (7). Trained weights use few exponents (order-0
entropy about 2.6 bits on SmolLM2), so the exponent is coded with rANS and the rest is kept raw:
- lossless (k = 7): 1 + 7 raw bits and ~2.7 coded bits, about 67% of bf16;
- lossy (k in 0, 1, 3): the mantissa rounded to its top k bits, to nearest (ties away from zero). A round-up
  that overflows the mantissa carries into the exponent (1.1111b -> 10.000b), which is the correctly rounded
  value. At the largest finite exponent (254) that carry would give Inf, so there the mantissa is truncated
  instead: a finite weight never becomes Inf. Every normal weight then changes by at most 2^-(k+1) relative
  (2^-k where truncated at the top). Subnormal weights (|w| < 2^-126, exponent 0) are rounded in the same
  absolute steps, so their relative change is not bounded; trained weights essentially never are subnormal.
A tensor with a non-finite value (exponent 255) is not coded: the container stores it raw.

The exponents are coded in LANE-symbol lanes with a 12-bit model (kernels/neuzip_decode.py gives the layout
and the decoder in three forms); this module encodes, and decodes through those kernels.
"""

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from kernels.neuzip_decode import (RANS_L, SCALE_BITS, lanes_for, log_fields_per_byte, neuzip_decode_torch,
                                   unpack_fields)
from kernels.neuzip_decode_cpu import neuzip_decode_numba
from serve.codecs.entropy import normalize_counts

BITS = (0, 1, 3, 7)
"""Mantissa bits kept: 7 is lossless."""
LANE = 2048
"""Symbols per lane, the default: 8 bytes of state and offset per lane cost 0.2% of a lossless stream, and a CPU
thread walks its lanes in turn. A GPU runs a lane's steps as a chain of dependent reads, one lane a thread, so a
launch takes as long as a lane whatever the tensor's size: a GPU server's files want shorter lanes (LANE_GPU)."""
LANE_GPU = 256
"""Symbols per lane for a GPU server: a launch of 256-symbol lanes takes a seventh of one of LANE's. On an H200
every budget-0 forward of the engine ran at 0.91-0.94x bf16 with these, 0.88-0.90x with LANE, for 1.2 points
more of bf16's bytes (bench-results/README.md#neuzip-on-a-gpu)."""
MAX_LANE = 1 << 16
"""The longest lane a file may declare (its header's bound)."""
EXPONENTS = 256


@dataclass(frozen=True)
class Encoded:
    """One tensor's NeuZip streams."""

    bits: int
    n: int
    freqs: np.ndarray
    """uint32 [256], summing to 2^12."""
    offsets: np.ndarray
    """int64 [lanes + 1]: each lane's first word."""
    words: np.ndarray
    """uint16: the lanes' rANS streams, one after another."""
    sm: np.ndarray
    """uint8: sign and kept mantissa, (bits + 1) bits an element."""

    @property
    def lanes(self) -> int:
        return self.offsets.size - 1

    @property
    def nbytes(self) -> int:
        """Bytes as stored: the streams, the sign/mantissa plane, 4 bytes a lane offset."""
        return self.words.nbytes + self.sm.nbytes + 4 * self.offsets.size


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"NeuZip keeps 0, 1, 3 or 7 mantissa bits; got {bits}")
    return bits


def check_lane(lane: int) -> int:
    """The lane length, if a file may have it; else ValueError."""
    if not 1 <= lane <= MAX_LANE:
        raise ValueError(f"a NeuZip lane holds 1 to {MAX_LANE} symbols; got {lane}")
    return lane


def lane_of(value: str) -> int:
    """Symbols a lane from a command line: "cpu" (LANE), "gpu" (LANE_GPU) or a number."""
    named = {"cpu": LANE, "gpu": LANE_GPU}
    if value in named:
        return named[value]
    if not value.isdigit():
        raise ValueError(f"a NeuZip lane length is cpu ({LANE}), gpu ({LANE_GPU}) or a number; got {value!r}")
    return check_lane(int(value))


def finite(bits16: np.ndarray) -> bool:
    """No Inf or NaN among these bf16 bit patterns."""
    return not bool(((bits16 >> 7) & 0xFF == 0xFF).any())


@njit(cache=True, nogil=True)
def _split(bits16: np.ndarray, k: int, log_per: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits -> (exponents uint8 [n], packed (sign, top-k mantissa) fields), rounding as the module says."""
    n = bits16.size
    width = k + 1
    per_mask = (1 << log_per) - 1
    exps = np.empty(n, np.uint8)
    sm = np.zeros(((n * width) + 7) // 8, np.uint8)
    shift = 7 - k
    for i in range(n):
        b = np.int64(bits16[i])
        s = b >> 15
        e = (b >> 7) & 0xFF
        m = b & 0x7F
        if shift:
            mk = (m + (1 << (shift - 1))) >> shift
            if mk >> k:  # the mantissa overflowed: carry into the exponent, unless that makes Inf
                if e >= 254:
                    mk = m >> shift
                else:
                    mk = 0
                    e += 1
        else:
            mk = m
        exps[i] = e
        sm[i >> log_per] |= np.uint8(((s << k) | mk) << ((i & per_mask) * width))
    return exps, sm


@njit(cache=True, nogil=True)
def _encode_lanes(exps: np.ndarray, freqs: np.ndarray, cum: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """rANS-code each lane backwards (so it decodes forwards), its final state first."""
    n = exps.size
    steps = (n + lanes - 1) // lanes
    buf = np.empty(steps, np.uint16)
    out = np.empty(n + 2 * lanes, np.uint16)
    offsets = np.empty(lanes + 1, np.int64)
    pos = 0
    for lane in range(lanes):
        count = (n - lane + lanes - 1) // lanes
        x = np.uint64(RANS_L)
        emitted = 0
        for j in range(count - 1, -1, -1):
            s = exps[j * lanes + lane]
            f = np.uint64(freqs[s])
            if x >= (f << np.uint64(20)):  # x must stay below 2^32 after the step: (2^16 >> 12) << 16 = 2^20
                buf[emitted] = np.uint16(x & np.uint64(0xFFFF))
                emitted += 1
                x >>= np.uint64(16)
            x = ((x // f) << np.uint64(SCALE_BITS)) + (x % f) + np.uint64(cum[s])
        offsets[lane] = pos
        out[pos] = np.uint16(x & np.uint64(0xFFFF))
        out[pos + 1] = np.uint16(x >> np.uint64(16))
        pos += 2
        for q in range(emitted - 1, -1, -1):
            out[pos] = buf[q]
            pos += 1
    offsets[lanes] = pos
    return out[:pos].copy(), offsets


def encode(bits16: np.ndarray, bits: int, lane: int = LANE) -> Encoded:
    """Code a finite bf16 tensor's bits (uint16, any shape) keeping `bits` mantissa bits."""
    check_bits(bits)
    flat = np.ascontiguousarray(bits16).reshape(-1).view(np.uint16)
    if flat.size == 0 or not finite(flat):
        raise ValueError("NeuZip codes non-empty tensors of finite values only")
    exps, sm = _split(flat, bits, log_fields_per_byte(bits))
    freqs = normalize_counts(np.bincount(exps, minlength=EXPONENTS), SCALE_BITS)
    cum = np.concatenate([[0], np.cumsum(freqs)]).astype(np.uint32)
    words, offsets = _encode_lanes(exps, freqs, cum, lanes_for(flat.size, lane))
    return Encoded(bits, flat.size, freqs, offsets, words, sm)


def decode_table(freqs: np.ndarray) -> np.ndarray:
    """int32 [4096]: slot -> sym | (freq - 1) << 8 | (slot - cum[sym]) << 20 (as uint32 bits)."""
    freqs = np.asarray(freqs, np.int64)
    if freqs.size != EXPONENTS or freqs.sum() != 1 << SCALE_BITS or (freqs < 0).any():
        raise ValueError("a NeuZip model has 256 frequencies summing to 4096")
    sym = np.repeat(np.arange(EXPONENTS, dtype=np.int64), freqs)
    cum = np.concatenate([[0], np.cumsum(freqs)])
    slot = np.arange(1 << SCALE_BITS, dtype=np.int64)
    entry = sym | ((freqs[sym] - 1) << 8) | ((slot - cum[sym]) << 20)
    return entry.astype(np.uint32).view(np.int32)


def rounded(bits16: np.ndarray, bits: int) -> np.ndarray:
    """What `bits` mantissa bits keep of these bf16 bits (uint16): the values a lossy decode gives."""
    flat = np.ascontiguousarray(bits16).reshape(-1).view(np.uint16)
    exps, sm = _split(flat, check_bits(bits), log_fields_per_byte(bits))
    field = unpack_fields(torch.from_numpy(sm), bits + 1, flat.size).numpy()
    m = (field & ((1 << bits) - 1)) << (7 - bits)
    return (((field >> bits) << 15) | (exps.astype(np.int64) << 7) | m).astype(np.uint16).reshape(bits16.shape)


def as_tensors(enc: Encoded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words int16, offsets int64, table int32, sm uint8): the kernels' arguments, sharing enc's memory."""
    return (torch.from_numpy(enc.words.view(np.int16)), torch.from_numpy(enc.offsets),
            torch.from_numpy(decode_table(enc.freqs)), torch.from_numpy(enc.sm))


def decode(enc: Encoded, reference: bool = False) -> np.ndarray:
    """The tensor's bf16 bits (uint16 [n]); raises ValueError if a lane does not decode cleanly.
    reference: the torch twin (the specification) instead of the numba fast path."""
    out = torch.empty(enc.n, dtype=torch.int16)
    fn = neuzip_decode_torch if reference else neuzip_decode_numba
    status = fn(*as_tensors(enc), enc.bits, out)
    bad = int((status != 0).sum())
    if bad:
        raise ValueError(f"{bad} of {enc.lanes} lanes do not decode cleanly")
    return out.numpy().view(np.uint16)
