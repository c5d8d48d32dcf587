"""`manyfold bench neuzip-gpu`: NeuZip on a CUDA GPU (issue 23, item 6), recorded beside the CPU table.

- The Triton decoder's speed, GB/s of bf16 written, on SmolLM2's coded Linear weights: one launch per weight (the
  whole model's weights back to back), one launch per group of weights as the engine decodes them at budget 0
  (serve/engine/neuzip/groups.py), and one launch over many weights at once (LAYERS_AT_ONCE layers' weights as
  one tensor: the GPU full), at the lane length the files use
  (serve/codecs/neuzip.py's LANE symbols a lane) and at shorter ones (more lanes: more parallel work and fewer
  steps a lane, for a few more bytes of lane starts). Every decode is checked bit for bit against the bf16
  weights before it is timed. DFloat11 reports about 262 GB/s on an A100 (METHODS.md).
- The engine's forwards on the GPU (BaseModelRuntime on `cuda`): a decode step (one new token a row over a
  64-token context) at 1, 8 and 64 rows and a prefill of 8 x 256, bf16 against lossless NeuZip at budget 0 at
  each lane length, after each NeuZip forward's logits were checked equal to bf16's bit for bit; runtimes take
  turns forward by forward, each forward synchronised; medians.

The GPU machine cannot reach the packaged model and a call carries at most 64 MiB, so `--export` writes here
the real SmolLM2's config, tokenizer and first EXPORTED decoder layers (about 7 MB each), and the GPU run builds
SmolLM2-135M's shape from them (`standin`): decoder layer i is the real layer i % EXPORTED, so every coded weight
is a real SmolLM2 weight and decodes as it would there; the embedding (its tied LM head, which NeuZip leaves raw)
is drawn at the real one's spread. Its logits are meaningless; its timings are SmolLM2's.
"""

import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from serve.bench.neuzip_steps import CONTEXT, PREFILL, forward_of
from serve.bench.report import finish
from serve.codecs import neuzip
from serve.codecs.neuzip_file import NEUZIP_FILE, NzpFile, compress
from serve.store.tensors import SafetensorsSource, save_tensors

EXPORTED = 5
"""Real decoder layers carried to the GPU machine."""
LANES = (neuzip.LANE, neuzip.LANE_GPU, 64)
"""Symbols a lane: the default, a GPU server's (`--lane gpu`), and shorter still."""
LAYERS_AT_ONCE = 6
ROWS = (1, 8, 64)
STANDIN_META = "standin.json"


def export(out: Path, layers: int = EXPORTED, src: Path | None = None) -> None:
    """The real SmolLM2's (or src's) config, tokenizer and first `layers` decoder layers (bf16), and its
    embedding's spread: what `standin` builds SmolLM2's shape from on a machine that cannot reach the packaged
    model."""
    from serve.data.models import smollm2_dir

    src = src or smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = SafetensorsSource(src)
    keep = {n: weights[n].to(torch.bfloat16) for n in weights
            if n == "model.norm.weight" or any(n.startswith(f"model.layers.{i}.") for i in range(layers))}
    save_tensors(out / "layers.safetensors", keep, metadata={"format": "pt"})
    std = float(weights["model.embed_tokens.weight"].float().std())
    (out / STANDIN_META).write_text(json.dumps({"layers": layers, "embed_std": std}) + "\n")


def standin(src: Path, out: Path, layers: int | None = None) -> Path:
    """A bf16 model directory of SmolLM2-135M's shape from `export`'s files (see the module's docstring);
    `layers` decoder layers (default: the config's)."""
    meta = json.loads((src / STANDIN_META).read_text())
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != STANDIN_META:
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    layers = layers or config["num_hidden_layers"]
    config.update(num_hidden_layers=layers, dtype="bfloat16")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    real = load_file(src / "layers.safetensors")
    tensors = {"model.norm.weight": real["model.norm.weight"]}
    for i in range(layers):
        prefix = f"model.layers.{i % meta['layers']}."
        for n in real:
            if n.startswith(prefix):
                tensors[f"model.layers.{i}." + n[len(prefix):]] = real[n].clone()
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(config["vocab_size"], config["hidden_size"], generator=g) * meta["embed_std"]
    tensors["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    save_tensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    return out


def coded_dirs(bf16: Path, work: Path) -> dict[int, Path]:
    """A lossless NeuZip copy of the bf16 model per lane length in LANES (built once)."""
    weights = SafetensorsSource(bf16)
    dirs = {}
    for lane in LANES:
        d = dirs[lane] = work / f"k7-lane{lane}"
        if not (d / NEUZIP_FILE).exists():
            shutil.copytree(bf16, d, dirs_exist_ok=True)
            compress({n: weights[n] for n in weights}, 7, d / NEUZIP_FILE, lane=lane)
    return dirs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_order(model_dir: Path) -> list[str]:
    """The model's parameter names in its own order (a file's are sorted by name), as the engine loads it."""
    from transformers import AutoModelForCausalLM

    from serve.engine.neuzip.coded import empty_model

    return [n for n, _ in empty_model(AutoModelForCausalLM, model_dir).named_parameters()]


def decoder_speed(bf16: Path, dirs: dict[int, Path], device: torch.device, repeats: int = 7) -> dict:
    """{lane: {per_weight_gbs, per_group_gbs, at_once_gbs, ...}}: the decoder over every coded weight, one launch
    each, a group a launch (the engine's GroupDecoder, in model order), and over LAYERS_AT_ONCE layers' weights as
    one tensor, each checked against the bf16 weights first."""
    from kernels import neuzip_decode, neuzip_decode_group
    from serve.engine.neuzip.groups import GroupDecoder

    weights = SafetensorsSource(bf16)
    out = {}
    for lane, d in dirs.items():
        nzp = NzpFile(d / NEUZIP_FILE)
        streams = [nzp.stream(n).to(device) for n, r in nzp.records.items() if r.codec == "neuzip"]
        size = max(s.numel for s in streams)
        buf = torch.empty(size, dtype=torch.int16, device=device)
        for s in streams:
            neuzip_decode(s.words, s.offsets, s.table, s.sm, 7, buf[: s.numel])
            if not torch.equal(buf[: s.numel].cpu(), weights[s.name].view(torch.int16).reshape(-1)):
                raise RuntimeError(f"lane {lane}: '{s.name}' does not decode to its bf16 weight")

        def every_weight() -> None:
            for s in streams:
                neuzip_decode(s.words, s.offsets, s.table, s.sm, 7, buf[: s.numel])

        total = sum(s.numel for s in streams)
        per_weight = _median_s(every_weight, device, repeats)
        by_name = {s.name: s for s in streams}
        decoder = GroupDecoder({n.rsplit(".", 1)[0]: by_name[n] for n in model_order(bf16) if n in by_name}, device)

        def every_group() -> None:  # a budget-0 forward's decoding, as the engine does it on a GPU
            for g in decoder.groups:
                neuzip_decode_group(g)

        for m in decoder.params:  # each weight as a forward gets it: its group decoded when first asked
            if not torch.equal(decoder.weight(m).cpu(), weights[f"{m}.weight"]):
                raise RuntimeError(f"lane {lane}: '{m}' does not decode to its bf16 weight in its group")
        per_group = _median_s(every_group, device, repeats)
        names = [s.name for s in streams if any(f"layers.{i}." in s.name for i in range(LAYERS_AT_ONCE))]
        flat = torch.cat([weights[n].view(torch.int16).reshape(-1) for n in names])
        enc = neuzip.encode(flat.numpy().view(np.uint16), 7, lane)
        args = [t.to(device) for t in neuzip.as_tensors(enc)]
        big = torch.empty(flat.numel(), dtype=torch.int16, device=device)
        if neuzip_decode(*args, 7, big).any() or not torch.equal(big.cpu(), flat):
            raise RuntimeError(f"lane {lane}: {LAYERS_AT_ONCE} layers as one tensor do not decode exactly")
        at_once = _median_s(lambda: neuzip_decode(*args, 7, big), device, repeats)
        coded = sum(s.nbytes for s in streams)
        out[lane] = {"weights": len(streams), "elements": total, "coded_over_bf16": coded / (2 * total),
                     "per_weight_ms": 1e3 * per_weight, "per_weight_gbs": 2 * total / per_weight / 1e9,
                     "launch_us": 1e6 * per_weight / len(streams), "groups": len(decoder.groups),
                     "per_group_ms": 1e3 * per_group, "per_group_gbs": 2 * total / per_group / 1e9,
                     "at_once_elements": flat.numel(), "at_once_lanes": enc.lanes, "at_once_ms": 1e3 * at_once,
                     "at_once_gbs": 2 * flat.numel() / at_once / 1e9}
        print(f"lane {lane}: {out[lane]['per_weight_gbs']:.1f} GB/s a weight at a time, "
              f"{out[lane]['per_group_gbs']:.1f} a group at a time, {out[lane]['at_once_gbs']:.1f} at once", flush=True)
    return out


@torch.no_grad()
def engine_steps(bf16: Path, dirs: dict[int, Path], device: torch.device, repeats: int = 9,
                 rows: tuple[int, ...] = ROWS) -> dict:
    """{config: {forward: median ms}}: bf16 and NeuZip k7 (budget 0) at each lane length, through the engine's
    runtime on `device`, taking turns forward by forward."""
    from serve.engine.model import BaseModelRuntime

    rts = {"bf16": BaseModelRuntime("bf16", bf16, device=str(device))}
    for lane, d in dirs.items():
        rt = rts[f"k7 lane {lane}"] = BaseModelRuntime(f"k7 lane {lane}", d, device=str(device))
        if rt.coded is None or rt.coded.kept:
            raise RuntimeError("every coded weight must be decoded on use (budget 0)")
    out: dict = {c: {} for c in rts}
    try:
        for n in (*rows, 0):
            shape = f"step {n}" if n else f"prefill {PREFILL[0]}x{PREFILL[1]}"
            fns = {c: forward_of(rt, n) for c, rt in rts.items()}
            want = fns["bf16"]()
            for c, fn in fns.items():
                if not torch.equal(fn(), want):
                    raise RuntimeError(f"{shape}: {c} logits differ from bf16's")
            runs: dict[str, list[float]] = {c: [] for c in rts}
            for _ in range(repeats if n else repeats // 2 + 1):
                for c, fn in fns.items():
                    runs[c].append(_median_s(fn, device, 1))
            for c, r in runs.items():
                out[c][shape] = 1e3 * statistics.median(r)
            print(f"{shape}: " + ", ".join(f"{c} {v[shape]:.2f} ms" for c, v in out.items()), flush=True)
    finally:
        for rt in rts.values():
            if rt.coded:
                rt.coded.close()
    return out


def gpu_name(device: torch.device) -> str:
    """The device as a report names it."""
    if device.type != "cuda":
        return f"{device.type} (no GPU)"
    p = torch.cuda.get_device_properties(device)
    return (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


def run_neuzip_gpu_bench(out: Path, src: Path, work: Path, device: str = "cuda", layers: int | None = None,
                         repeats: int = 7) -> dict:
    """src: `export`'s files. layers: decoder layers of the stand-in (default: SmolLM2's 30)."""
    import triton

    dev = torch.device(device)
    torch.manual_seed(0)
    bf16 = work / "bf16"
    if not (bf16 / "model.safetensors").exists():
        standin(src, bf16, layers)
    dirs = coded_dirs(bf16, work)
    print("decoder speed ...", flush=True)
    speed = decoder_speed(bf16, dirs, dev, repeats)
    print("engine forwards ...", flush=True)
    steps = engine_steps(bf16, dirs, dev, repeats + 2)
    report = {"device": gpu_name(dev), "triton": triton.__version__, "model": "SmolLM2-135M stand-in: "
              f"{EXPORTED} real layers repeated (serve/bench/neuzip_gpu.py)", "context": CONTEXT,
              "decoder": {str(k): v for k, v in speed.items()}, "engine_steps_ms": steps,
              "dfloat11_a100_gbs": 262}
    return finish(report, out, print_report)


def print_report(r: dict) -> None:
    print(f"\nNeuZip on {r['device']}, Triton {r['triton']}; {r['model']}")
    print("\nTriton decoder, lossless k7, GB/s of bf16 written (DFloat11 reports about "
          f"{r['dfloat11_a100_gbs']} GB/s on an A100)")
    print(f"{'lane':>6}{'held':>8}{'a weight at a time':>20}{'us/launch':>11}{'a group at a time':>19}{'at once':>10}"
          f"{'lanes':>9}")
    for lane, d in r["decoder"].items():
        group = f"{d['per_group_gbs']:.1f} ({d['groups']})" if "per_group_gbs" in d else "-"
        print(f"{lane:>6}{d['coded_over_bf16']:>8.1%}{d['per_weight_gbs']:>20.1f}{d['launch_us']:>11.1f}{group:>19}"
              f"{d['at_once_gbs']:>10.1f}{d['at_once_lanes']:>9}")
    steps = r["engine_steps_ms"]
    print(f"\nengine forwards (step N: one new token for each of N rows over {r['context']} tokens), ms, medians; "
          "NeuZip at budget 0")
    shapes = list(steps["bf16"])
    print(f"{'config':<16}" + "".join(f"{s:>16}" for s in shapes))
    for c, v in steps.items():
        print(f"{c:<16}" + "".join(f"{v[s]:>8.2f}{steps['bf16'][s] / v[s]:>7.2f}x" for s in shapes))
    tok = {c: 64e3 / v["step 64"] for c, v in steps.items() if "step 64" in v}
    if tok:
        print("tokens/s at 64 rows: " + ", ".join(f"{c} {t:.0f}" for c, t in tok.items()))
