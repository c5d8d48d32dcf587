import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.codecs import entropy
from serve.codecs.fmdelta import decode_delta, encode_delta, pool_map

UINT = {torch.float32: np.uint32, torch.float16: np.uint16, torch.bfloat16: np.uint16}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().view(UINT[t.dtype])


def roundtrip(base: np.ndarray, fine: np.ndarray, chunk_elems: int = 1 << 20, workers: int = 1) -> np.ndarray:
    coded = encode_delta(base, fine, chunk_elems, pool_map(workers))
    out = np.empty_like(fine)
    assert decode_delta(base, coded.freqs, coded.chunks, out, pool_map(workers)) == entropy.OK
    return out


def special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny, -info.tiny, info.tiny / 4,
            -info.tiny / 8, info.max, -info.max, info.eps, 1.0, -1.0, 3.5, -2.25]
    t = torch.tensor(vals, dtype=torch.float32).to(dtype)
    # NaNs with distinct payloads and signs, written as raw bits.
    u = bits(t).copy()
    top = np.array(1 << (8 * u.itemsize - 1), u.dtype)
    nan_bits = np.array([bits(torch.tensor([float("nan")], dtype=dtype))[0]] * 3, u.dtype)
    nan_bits[1] |= 1
    nan_bits[2] |= top
    return torch.from_numpy(np.concatenate([u, nan_bits]).view(np.uint8).copy()).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_special_values_roundtrip_bit_exact_in_every_direction(dtype):
    s = special_values(dtype)
    base = s.repeat_interleave(s.numel())  # every pair (base value, fine value)
    fine = s.repeat(s.numel())
    assert np.array_equal(roundtrip(bits(base), bits(fine)), bits(fine))
    assert np.array_equal(roundtrip(bits(fine), bits(base)), bits(base))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sign_flips_identical_and_extreme_deltas(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3001, generator=g) * 0.02).to(dtype)
    fine = base.clone()
    fine[::3] = -fine[::3]  # sign flips
    fine[1::7] = torch.finfo(dtype).max  # largest possible |d|
    assert np.array_equal(roundtrip(bits(base), bits(fine)), bits(fine))
    assert np.array_equal(roundtrip(bits(base), bits(base)), bits(base))


@pytest.mark.parametrize("workers", [1, 2])
def test_chunked_streams_decode_to_the_same_bits(workers):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(10_007, generator=g)
    fine = base + torch.randn(10_007, generator=g) * 1e-3
    assert np.array_equal(roundtrip(bits(base), bits(fine), chunk_elems=1000, workers=workers), bits(fine))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_delta_within_one_percent_of_order0_bound(dtype):
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(400_000, generator=g) * 0.03).to(dtype)
    fine = (base.float() + torch.randn(400_000, generator=g) * 2e-4).to(dtype)
    coded = encode_delta(bits(base), bits(fine))
    assert coded.nbytes <= coded.order0_bytes() * 1.01
    assert coded.nbytes < base.numel() * base.element_size()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.uint16, np.uint32]), st.data())
def test_any_bit_patterns_roundtrip(udtype, data):
    n = data.draw(st.integers(1, 300))
    hi = int(np.iinfo(udtype).max)
    base = np.array(data.draw(st.lists(st.integers(0, hi), min_size=n, max_size=n)), udtype)
    fine = np.array(data.draw(st.lists(st.integers(0, hi), min_size=n, max_size=n)), udtype)
    assert np.array_equal(roundtrip(base, fine, chunk_elems=64), fine)
