import numpy as np
import pytest
import torch

from serve.codecs import neuzip_file as nf
from serve.codecs.neuzip import rounded
from serve.errors import ArtifactError
from tests.conftest import same_bits

CODED = "model.layers.0.mlp.up_proj.weight"


def weights(rng: torch.Generator) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.randn(100, 64, generator=rng).bfloat16(),
            CODED: (torch.randn(128, 64, generator=rng) * 0.02).bfloat16(),
            "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 64, generator=rng) * 0.02).bfloat16(),
            "model.layers.0.input_layernorm.weight": torch.ones(64).bfloat16(),
            "odd": torch.tensor([[1.0, float("inf")], [float("nan"), -0.0]]).bfloat16(),
            "steps": torch.arange(5)}


@pytest.mark.parametrize("bits", [7, 3, 0])
def test_roundtrip_codes_only_linear_weights_and_keeps_the_rest_exact(bits, rng, tmp_path):
    w = weights(rng)
    stats = nf.compress(w, bits, tmp_path / "m.nzp", metadata={"format": "pt"})
    f = nf.NzpFile(tmp_path / "m.nzp")
    assert {n for n, r in f.records.items() if r.codec == "neuzip"} == {CODED, "model.layers.0.self_attn.q_proj.weight"}
    assert stats.codecs == {"neuzip": 2, "raw": 4} and f.header.metadata == {"format": "pt"}
    for name, t in w.items():
        want = t if f.records[name].codec == "raw" else torch.from_numpy(
            rounded(t.view(torch.int16).numpy().view(np.uint16), bits).view(np.int16)).view(torch.bfloat16)
        assert same_bits(f.tensor(name), want), name
    if bits == 7:
        assert all(r.digest == r.source_digest for r in f.records.values())


def test_float32_weights_must_be_cast_first(rng, tmp_path):
    with pytest.raises(ValueError, match="float32: cast the model to bfloat16"):
        nf.compress({CODED: torch.randn(8, 8, generator=rng)}, 7, tmp_path / "m.nzp")


def _corrupt_at(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damage_is_one_line_naming_the_file_and_the_tensor(rng, tmp_path):
    path = tmp_path / "m.nzp"
    nf.compress(weights(rng), 7, path)
    f = nf.NzpFile(path)
    r = f.records[CODED]
    _corrupt_at(path, f._mapped.payload_start + r.offset + r.length // 2)
    with pytest.raises(ArtifactError, match=f"{path}: tensor '{CODED}': payload checksum mismatch") as e:
        nf.NzpFile(path).stream(CODED)
    assert "\n" not in str(e.value)
    nf.NzpFile(path).tensor("model.layers.0.self_attn.q_proj.weight")  # the others still read


def test_truncated_and_tampered_headers_are_refused_before_any_decode(rng, tmp_path):
    path = tmp_path / "m.nzp"
    nf.compress(weights(rng), 3, path)
    data = path.read_bytes()
    (tmp_path / "cut.nzp").write_bytes(data[: len(data) - 100])
    with pytest.raises(ArtifactError, match="truncated: tensor"):
        nf.NzpFile(tmp_path / "cut.nzp")
    _corrupt_at(path, 80)  # inside the JSON header
    with pytest.raises(ArtifactError, match="header checksum mismatch"):
        nf.NzpFile(path)
    (tmp_path / "other.nzp").write_bytes(b"MFDELTA\0" + data[8:])
    with pytest.raises(ArtifactError, match="not a NeuZip file"):
        nf.NzpFile(tmp_path / "other.nzp")


def test_a_stream_whose_lanes_fail_is_caught_at_decode_with_the_tensor_named(rng, tmp_path):
    """Past the payload checksum (a bug, or memory damaged after load): the kernels' status still catches it."""
    nf.compress(weights(rng), 7, tmp_path / "m.nzp")
    s = nf.NzpFile(tmp_path / "m.nzp").stream(CODED)
    s.words[5] ^= 0x0F0F
    with pytest.raises(ArtifactError, match=f"tensor '{CODED}': .* lanes do not decode cleanly"):
        nf.decode(s)


def _rewritten(path, out, name: str, **changes) -> None:
    """path's tensors with record `name` changed, under a valid header checksum: what a writer with a bug (or a
    crafted file) could produce."""
    from serve.codecs import container

    f = nf.NzpFile(path)
    tensors = [r.model_copy(update=changes) if r.name == name else r for r in f.header.tensors]
    end = max(r.offset + r.length for r in f.header.tensors)
    payload = bytes(f._mapped.map[f._mapped.payload_start: f._mapped.payload_start + end])
    container.write(out, nf.MAGIC, nf.VERSION, f.header.model_copy(update={"tensors": tensors}), [payload])


def test_a_lossless_file_whose_digests_differ_from_their_source_is_refused(rng, tmp_path):
    nf.compress(weights(rng), 7, tmp_path / "m.nzp")
    _rewritten(tmp_path / "m.nzp", tmp_path / "bad.nzp", CODED, source_digest="0" * 32)
    with pytest.raises(ArtifactError, match=f"tensor '{CODED}': stored losslessly, yet its digest differs"):
        nf.NzpFile(tmp_path / "bad.nzp")


def test_a_shape_too_large_to_count_is_refused_not_wrapped(rng, tmp_path):
    nf.compress(weights(rng), 3, tmp_path / "m.nzp")
    _rewritten(tmp_path / "m.nzp", tmp_path / "bad.nzp", "steps", shape=[1 << 32, 1 << 32])  # int64 product: 0
    with pytest.raises(ArtifactError, match="tensor 'steps' claims"):
        nf.NzpFile(tmp_path / "bad.nzp")
