import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.codecs.fmdelta_file import FmdFile, compress, decompress, match_base_name
from serve.errors import ArtifactError, VariantIncompatible
from serve.store.tensors import SafetensorsSource, save_tensors
from tests.conftest import finetune_of, same_bits, tiny_state


@pytest.fixture
def pair(rng):
    base = tiny_state(rng)
    return base, finetune_of(base, rng)


def test_file_roundtrip_keeps_names_dtypes_shapes_bytes_and_metadata(tmp_path, rng):
    base = {**tiny_state(rng), **{f"bf.{k}": v.bfloat16() for k, v in tiny_state(rng).items()},
            **{f"h.{k}": v.half() for k, v in tiny_state(rng).items()}}
    fine = finetune_of(base, rng)
    fine["ids"] = torch.arange(7, dtype=torch.int64)  # non-float: standalone
    fine["empty"] = torch.empty(0, 4)
    fine["scalar"] = torch.tensor(2.5)
    fine["embed.weight"] = torch.randn(53, 8, generator=rng)  # resized: standalone
    compress(base, fine, tmp_path / "x.fmd", metadata={"format": "pt"})
    save_tensors(tmp_path / "base.safetensors", base)
    decompress(tmp_path / "x.fmd", SafetensorsSource(tmp_path / "base.safetensors"), tmp_path / "out.safetensors")
    out = SafetensorsSource(tmp_path / "out.safetensors")
    assert list(sorted(out)) == sorted(fine)
    assert all(same_bits(out[k], fine[k]) for k in fine)
    assert out.metadata == {"format": "pt"}
    codecs = {r.name: r.codec for r in FmdFile(tmp_path / "x.fmd").header.tensors}
    assert codecs["layers.0.norm.weight"] == "same" and codecs["layers.1.mlp.weight"] == "delta"
    assert codecs["ids"] == codecs["embed.weight"] == codecs["head.weight"] == "raw"


def test_one_tensor_decodes_alone(tmp_path, pair):
    base, fine = pair
    compress(base, fine, tmp_path / "x.fmd")
    f = FmdFile(tmp_path / "x.fmd")
    assert same_bits(f.decode("layers.1.attn.weight", base), fine["layers.1.attn.weight"])


def test_classifier_names_match_the_bare_encoder():
    base = {"encoder.layer.0.w", "embeddings.x"}
    assert match_base_name("bert.encoder.layer.0.w", base) == "encoder.layer.0.w"
    assert match_base_name("embeddings.x", base) == "embeddings.x"
    assert match_base_name("classifier.weight", base) is None
    assert match_base_name("w", {"model.w"}) == "model.w"


def test_delta_against_the_wrong_base_fails_clearly(tmp_path, pair, rng):
    base, fine = pair
    compress(base, fine, tmp_path / "x.fmd")
    other = tiny_state(rng)
    with pytest.raises(VariantIncompatible, match="different base.*wrong --base"):
        FmdFile(tmp_path / "x.fmd").decode_all(other)
    shrunk = {**base, "layers.1.mlp.weight": base["layers.1.mlp.weight"][:5]}
    with pytest.raises(VariantIncompatible, match="expects F32"):
        FmdFile(tmp_path / "x.fmd").decode_all(shrunk)
    with pytest.raises(VariantIncompatible, match="no tensor"):
        FmdFile(tmp_path / "x.fmd").decode_all({})


def _written(tmp_path, pair) -> bytes:
    base, fine = pair
    compress(base, fine, tmp_path / "x.fmd")
    return (tmp_path / "x.fmd").read_bytes()


def _load(tmp_path, data: bytes, base) -> None:
    p = tmp_path / "bad.fmd"
    p.write_bytes(data)
    FmdFile(p).decode_all(base)


def test_every_truncation_is_a_clear_error(tmp_path, pair):
    data = _written(tmp_path, pair)
    for cut in [0, 5, 40, 56, 57, 200, len(data) // 2, len(data) - 1]:
        with pytest.raises(ArtifactError, match="bad.fmd: (truncated|header checksum)"):
            _load(tmp_path, data[:cut], pair[0])


def test_bad_magic_and_version(tmp_path, pair):
    data = _written(tmp_path, pair)
    with pytest.raises(ArtifactError, match="bad magic"):
        _load(tmp_path, b"X" + data[1:], pair[0])
    with pytest.raises(ArtifactError, match="format version 9"):
        _load(tmp_path, data[:8] + struct.pack("<I", 9) + data[12:], pair[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_files_raise_artifact_errors_only(tmp_path, pair, data):
    """Any bit flip, byte overwrite or cut: either an ArtifactError or (flip in padding) a correct decode."""
    raw = bytearray(_written(tmp_path, pair))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        if data.draw(st.booleans()):
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        else:
            raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        p = tmp_path / "fuzz.fmd"
        p.write_bytes(bytes(raw))
        out = FmdFile(p).decode_all(pair[0])
    except ArtifactError as e:
        assert "fuzz.fmd" in str(e) and "\n" not in str(e)
    else:
        assert all(same_bits(out[k], pair[1][k]) for k in pair[1])


def test_payload_corruption_is_caught_by_its_checksum(tmp_path, pair):
    data = bytearray(_written(tmp_path, pair))
    data[-3] ^= 0x10
    with pytest.raises(ArtifactError, match="payload checksum mismatch"):
        _load(tmp_path, bytes(data), pair[0])


def test_interrupted_write_leaves_no_file(tmp_path, pair, monkeypatch):
    base, fine = pair
    import serve.store.writer as writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(writer.os, "replace", boom)
    with pytest.raises(OSError):
        compress(base, fine, tmp_path / "x.fmd")
    assert list(tmp_path.iterdir()) == []

