"""`manyfold bench neuzip-gpu`'s plumbing on the CPU and a tiny model: the stand-in repeats the exported layers and
the bench checks every coded form against bf16 before it times it (the figures are the GPU machine's)."""

import json

import torch
from safetensors.torch import load_file

from serve.bench.neuzip_gpu import LANES, export, run_neuzip_gpu_bench, standin
from tests.models import write_tiny_causal


def test_the_standin_repeats_the_exported_layers_and_keeps_the_rest_of_the_model(tmp_path):
    src = write_tiny_causal(tmp_path / "lm", layers=3)
    export(tmp_path / "export", layers=2, src=src)
    out = standin(tmp_path / "export", tmp_path / "standin", layers=5)
    real, made = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 5
    for i in range(5):
        for part in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            want = real[f"model.layers.{i % 2}.{part}"].to(torch.bfloat16)
            assert torch.equal(made[f"model.layers.{i}.{part}"], want)
    assert made["model.embed_tokens.weight"].shape == real["model.embed_tokens.weight"].shape
    assert not any(n.startswith("model.layers.2.") for n in load_file(tmp_path / "export" / "layers.safetensors"))


def test_the_bench_times_every_lane_length_after_checking_it_decodes_to_bf16(tmp_path):
    export(tmp_path / "export", layers=1, src=write_tiny_causal(tmp_path / "lm"))
    r = run_neuzip_gpu_bench(tmp_path / "r.json", tmp_path / "export", tmp_path / "work", "cpu", layers=2,
                             repeats=1)
    assert set(r["decoder"]) == {str(lane) for lane in LANES}
    assert all(d["per_weight_gbs"] > 0 and d["weights"] == 14 for d in r["decoder"].values())
    assert set(r["engine_steps_ms"]) == {"bf16", *(f"k7 lane {lane}" for lane in LANES)}
    assert json.loads((tmp_path / "r.json").read_text())["engine_steps_ms"] == r["engine_steps_ms"]
