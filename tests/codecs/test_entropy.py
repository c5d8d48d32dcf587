import numpy as np
import pytest

from serve.codecs import entropy


def _roundtrip(syms: np.ndarray, alphabet: int) -> tuple[np.ndarray, np.ndarray, int]:
    counts = np.bincount(syms, minlength=alphabet)
    freqs = entropy.normalize_counts(counts)
    cum = entropy.cumulative(freqs)
    words = entropy.rans_encode(syms, entropy.encoder_tables(freqs))
    out = np.empty_like(syms)
    status = entropy.rans_decode(words, freqs, cum, entropy.decode_table(freqs, entropy.SCALE_BITS),
                                 entropy.SCALE_BITS, out)
    return out, words, status


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000])
def test_rans_roundtrip_any_length(n):
    syms = np.random.default_rng(n).integers(0, 33, n).astype(np.uint8)
    out, _, status = _roundtrip(syms, 33)
    assert status == entropy.OK
    assert np.array_equal(out, syms)


def test_rans_size_within_a_tenth_percent_of_order0_bound():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(65) * 0.3)
    syms = rng.choice(65, size=200_000, p=p).astype(np.uint8)
    out, words, status = _roundtrip(syms, 65)
    bound = entropy.order0_bits(np.bincount(syms, minlength=65))
    assert status == entropy.OK and np.array_equal(out, syms)
    assert words.size * 32 <= bound * 1.001 + 128


def test_single_symbol_stream_costs_only_the_final_states():
    syms = np.full(10_000, 7, np.uint8)
    out, words, status = _roundtrip(syms, 33)
    assert status == entropy.OK and np.array_equal(out, syms)
    assert words.size == 4


def test_normalized_model_keeps_every_present_symbol():
    counts = np.zeros(65, np.int64)
    counts[0], counts[1], counts[64] = 10**9, 1, 3
    freqs = entropy.normalize_counts(counts)
    assert int(freqs.sum()) == 1 << entropy.SCALE_BITS
    assert all(freqs[[0, 1, 64]] >= 1) and freqs[2:64].sum() == 0


def test_truncated_or_padded_stream_is_reported_not_misread():
    syms = np.random.default_rng(2).integers(0, 33, 5000).astype(np.uint8)
    counts = np.bincount(syms, minlength=33)
    freqs = entropy.normalize_counts(counts)
    cum = entropy.cumulative(freqs)
    table = entropy.decode_table(freqs, entropy.SCALE_BITS)
    words = entropy.rans_encode(syms, entropy.encoder_tables(freqs))
    out = np.empty_like(syms)
    assert entropy.rans_decode(words[:-3], freqs, cum, table, entropy.SCALE_BITS, out) != entropy.OK
    padded = np.concatenate([words, np.zeros(2, np.uint32)])
    assert entropy.rans_decode(padded, freqs, cum, table, entropy.SCALE_BITS, out) == entropy.ERR_TRAILING


def test_division_free_encoder_handles_frequency_one_and_full_range_symbols():
    syms = np.zeros(100_000, np.uint8)
    syms[[7, 999, 31_337]] = [1, 2, 64]  # each will get frequency 1 of 2^16
    out, _, status = _roundtrip(syms, 65)
    assert status == entropy.OK and np.array_equal(out, syms)
    assert entropy.normalize_counts(np.bincount(syms, minlength=65))[[1, 2, 64]].tolist() == [1, 1, 1]
