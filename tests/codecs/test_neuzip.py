import numpy as np
import pytest
import torch

from serve.codecs import neuzip
from serve.codecs.entropy import order0_bits

SPECIAL = [0x0000, 0x8000,  # +0, -0
           0x0001, 0x807F, 0x0040,  # subnormals
           0x7F7F, 0xFF7F, 0x7F00,  # the largest finite magnitudes (exponent 254)
           0x7EFF, 0x3FFF, 0xBF80, 0x3F80, 0x0080]  # carries into the next exponent; +-1; the smallest normal


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def trained_like(rng: torch.Generator, n: int = 20_000) -> np.ndarray:
    w = torch.randn(n, generator=rng) * 0.02
    w[:: 97] *= 30  # a few outliers, as trained weights have
    return np.concatenate([bits_of(w), np.array(SPECIAL, np.uint16)])


def as_float(bits16: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits16.astype(np.int16)).view(torch.bfloat16).double().numpy()


def test_lossless_decodes_bit_identically_including_zeros_subnormals_and_extremes(rng):
    bits16 = trained_like(rng)
    enc = neuzip.encode(bits16, 7)
    assert np.array_equal(neuzip.decode(enc), bits16)
    assert np.array_equal(neuzip.decode(enc, reference=True), bits16)


def test_lossless_size_is_the_raw_bits_plus_the_exponent_entropy(rng):
    bits16 = bits_of(torch.randn(300_000, generator=rng) * 0.02)
    enc = neuzip.encode(bits16, 7)
    bound = order0_bits(np.bincount((bits16 >> 7) & 0xFF, minlength=256)) / 8 + bits16.size  # bytes
    assert bound <= enc.nbytes <= 1.006 * bound  # 12-bit model, lane states and offsets: under 0.6%
    assert enc.nbytes < 0.68 * bits16.nbytes


@pytest.mark.parametrize("bits", [0, 1, 3])
def test_lossy_changes_each_normal_weight_by_at_most_two_to_the_minus_k(bits, rng):
    bits16 = trained_like(rng)
    enc = neuzip.encode(bits16, bits)
    got = neuzip.decode(enc)
    assert np.array_equal(got, neuzip.rounded(bits16, bits))
    a, b = as_float(bits16), as_float(got)
    normal = (bits16 >> 7) & 0xFF > 0
    assert np.all(np.abs(b - a)[normal] <= 2.0 ** -bits * np.abs(a)[normal])
    assert np.all(np.isfinite(b)) and np.array_equal(np.signbit(a), np.signbit(b))
    assert enc.nbytes < neuzip.encode(bits16, 7).nbytes


def test_lossy_rounds_to_nearest_and_carries_into_the_exponent_but_never_to_inf():
    got = neuzip.rounded(np.array([0x3FFF, 0x3F88, 0x3F87, 0x7F7F, 0xFF7F, 0x7F3F], np.uint16), 3)
    # 1.9921875 -> 2.0 (carry); 1.0625 (a tie) -> 1.125, away from zero; 1.0546875 -> 1.0; the largest finite
    # weights are truncated, not carried into Inf; 0x7F3F rounds up within exponent 254.
    assert got.tolist() == [0x4000, 0x3F90, 0x3F80, 0x7F70, 0xFF70, 0x7F40]
    assert neuzip.rounded(np.array([0x3FC0], np.uint16), 0).tolist() == [0x4000]  # 1.5 -> 2 with no mantissa


def test_encode_refuses_non_finite_and_empty_tensors_and_unknown_bits(rng):
    with pytest.raises(ValueError, match="finite"):
        neuzip.encode(bits_of(torch.tensor([1.0, float("nan")])), 7)
    with pytest.raises(ValueError, match="finite"):
        neuzip.encode(bits_of(torch.tensor([float("-inf")])), 3)
    with pytest.raises(ValueError, match="non-empty"):
        neuzip.encode(np.zeros(0, np.uint16), 7)
    with pytest.raises(ValueError, match="0, 1, 3 or 7"):
        neuzip.encode(trained_like(rng), 4)


def test_a_damaged_stream_raises_instead_of_returning_wrong_weights(rng):
    enc = neuzip.encode(trained_like(rng), 7, lane=256)
    words = enc.words.copy()
    words[len(words) // 2] ^= 0x1234
    with pytest.raises(ValueError, match="lanes do not decode cleanly"):
        neuzip.decode(neuzip.Encoded(enc.bits, enc.n, enc.freqs, enc.offsets, words, enc.sm))
