"""`manyfold bench neuzip`: a NeuZip base against bf16 and int8 weight-only quantisation (after NeuZip's Table 3).

SmolLM2-135M and all-MiniLM-L6-v2, both cast to bf16, served as: bf16 uncompressed; NeuZip k = 7 (lossless),
3, 1, 0; int8 weight-only (torchao, the `bench` extra). Each configuration runs in its own process so
that its memory is its own: resident weight bytes (counted from the tensors, and measured as the process's RSS
growth over loading and one small forward, numba's compiled code already in the baseline), peak RSS, quality (SmolLM2: perplexity on held-out BBC articles; MiniLM: cosine of its
sentence embeddings to the bf16 model's), and throughput at decoded-layer budgets 0 and the default (SmolLM2:
generated tokens/s, 8 rows; MiniLM: tokens encoded/s). Before those, the engine's own decode steps and prefill,
bf16 against k = 7, split into decoding, matmul and the rest (serve/bench/neuzip_steps.py). Then decode speed on
one core and on all, and the sizes of two anchors on the same tensors: zstd -19 and the order-0 entropy of the
exponents. Prints tables, writes JSON.
"""

import gc
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import zstandard

from serve.bench.report import NO_GPU, finish, machine, median_time
from serve.codecs.neuzip_file import NEUZIP_FILE, NzpFile, cast_to_bf16, encode_dir
from serve.config import NEUZIP_DECODED_MIB
from serve.store.model_dir import NOT_COPIED

MODELS = ("smollm2", "minilm")
CONFIGS = ("bf16", "k7", "k3", "k1", "k0", "int8")
SEQ = 256
"""Tokens per perplexity window."""
PPL_WINDOWS = 24
GEN_ROWS, GEN_TOKENS = 8, 16
ENC_TEXTS = 64
SWEEP = (0.25, 0.5, 0.75, 1.0)
"""Decoded-layer budgets, as shares of the coded weights' bf16 bytes, timed for lossless SmolLM2."""
MIB = 1 << 20


def _model_dir(model: str) -> Path:
    from serve.data.models import minilm_dir, smollm2_dir

    return smollm2_dir() if model == "smollm2" else minilm_dir()


def prepare(work: Path) -> dict[str, dict[str, Path]]:
    """Per model: a bf16 copy, and a copy with NEUZIP_FILE for each k (built once, kept in `work`)."""
    dirs: dict[str, dict[str, Path]] = {}
    for model in MODELS:
        bf16 = work / model / "bf16"
        if not (bf16 / "config.json").exists():
            shutil.copytree(_model_dir(model), bf16, ignore=shutil.ignore_patterns(*NOT_COPIED), dirs_exist_ok=True)
            cast_to_bf16(bf16)
        dirs[model] = {"bf16": bf16, "int8": bf16}
        for k in (7, 3, 1, 0):
            d = work / model / f"k{k}"
            if not (d / NEUZIP_FILE).exists():
                shutil.copytree(bf16, d, dirs_exist_ok=True)
                encode_dir(d, k, keep_weights=True)
            dirs[model][f"k{k}"] = d
    return dirs


# ---- one configuration, in its own process


def _rss() -> int:
    """This process's resident memory, after handing freed heap memory back to the system (glibc keeps what a
    load's temporaries freed otherwise, which is not memory the model holds)."""
    import ctypes

    from serve.engine.memory import resident_bytes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_bytes(torch.device("cpu"))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def _int8(model: torch.nn.Module) -> torch.nn.Module:
    """torchao's int8 weight-only quantisation (per-row scales) of every Linear but a tied LM head (the
    embedding it shares stays bf16)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False),
              filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn != "lm_head")
    return model


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind t: a quantised weight is a tensor subclass of its data, scales and zero points."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    return [x for n in t.__tensor_flatten__()[0] for x in _leaves(getattr(t, n))]


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor the model holds (parameters and buffers, each storage once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        for x in _leaves(t):
            key = (x.untyped_storage().data_ptr(), x.dtype, tuple(x.shape))
            if not x.is_meta and key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
    return total


def _load(model: str, config: str, path: Path, decoded_bytes: int) -> tuple[torch.nn.Module, int, int]:
    """(the model as transformers calls it, resident weight bytes counted from its tensors, bf16 bytes of its
    coded weights)."""
    from transformers import AutoModel, AutoModelForCausalLM

    cls = AutoModelForCausalLM if model == "smollm2" else AutoModel
    if config.startswith("k"):
        from serve.engine.model import BaseModelRuntime

        rt = BaseModelRuntime(model, path, decoded_bytes=decoded_bytes)
        return rt.model, rt.nbytes, rt.coded.decoded_size
    m = cls.from_pretrained(path, dtype=torch.bfloat16).eval()
    if config == "int8":
        m = _int8(m)
    return m, _weight_bytes(m), 0


def _warm_decoders() -> None:
    """Compile the numba encoder and decoders once, before anything is measured."""
    from serve.codecs import neuzip

    bits16 = (torch.randn(4096) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for k in neuzip.BITS:
        neuzip.decode(neuzip.encode(bits16, k))


def _ppl_windows(tok) -> torch.Tensor:
    from serve.data.datasets import bbc_topics

    text = "\n\n".join(e.text for e in bbc_topics("test").examples[:200])
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    return ids[: PPL_WINDOWS * SEQ].view(PPL_WINDOWS, SEQ)


@torch.no_grad()
def _perplexity(m, windows: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for batch in windows.split(8):
        logits = m(input_ids=batch).logits[:, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return float(np.exp(nll / count))


def _enc_texts() -> list[str]:
    from serve.data.datasets import sms_spam

    return [e.text for e in sms_spam("test").examples[:ENC_TEXTS]]


@torch.no_grad()
def _embed(m, tok, texts: list[str]) -> torch.Tensor:
    enc = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    hidden = m(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1), int(enc["attention_mask"].sum())


def _throughput(model: str, m, tok, repeats: int = 5) -> float:
    """SmolLM2: generated tokens/s (GEN_ROWS rows, GEN_TOKENS each, greedy); MiniLM: tokens encoded/s."""
    if model == "smollm2":
        tok.padding_side = "left"
        enc = tok([f"Story {i}: once upon a time, in a small town by the sea," for i in range(GEN_ROWS)],
                  return_tensors="pt", padding=True)

        def run():
            m.generate(**enc, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False,
                       pad_token_id=tok.pad_token_id)
        work = GEN_ROWS * GEN_TOKENS
    else:
        texts = _enc_texts()
        work = _embed(m, tok, texts)[1]

        def run():
            _embed(m, tok, texts)
    return work / median_time(run, repeats)


def measure(model: str, config: str, path: str, work: str) -> dict:
    """One configuration, measured in this process (run it in a fresh one)."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    data = _ppl_windows(tok) if model == "smollm2" else _enc_texts()
    _warm_decoders()  # numba's compiled code in the baseline, not in the weights
    probe = tok(["The weather today is"], return_tensors="pt")
    gc.collect()
    rss0 = _rss()
    m, counted, coded = _load(model, config, Path(path), 0)
    with torch.no_grad():
        m(**probe)  # one small forward: mapped weights are paged in, activations stay small
    gc.collect()
    row = {"model": model, "config": config, "weight_bytes": counted, "rss_growth_bytes": _rss() - rss0}
    if model == "smollm2":
        row["perplexity"] = _perplexity(m, data)
    else:
        vecs = _embed(m, tok, data)[0]
        ref_path = Path(work) / "minilm-bf16-embeddings.npy"
        if config == "bf16":
            np.save(ref_path, vecs.numpy())
        ref = torch.from_numpy(np.load(ref_path))
        cos = (vecs * ref).sum(-1)
        row |= {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
    row["throughput_budget0"] = _throughput(model, m, tok)
    row["peak_rss_bytes"] = _peak_rss()
    if config.startswith("k"):
        del m
        gc.collect()
        budgets = {"default": NEUZIP_DECODED_MIB * MIB} if NEUZIP_DECODED_MIB else {}
        if model == "smollm2" and config == "k7":
            budgets |= {f"{share:.0%}": int(share * coded) for share in SWEEP}
        row["coded_bf16_bytes"] = coded
        row["throughput_by_budget"] = {}
        for name, budget in budgets.items():
            m, counted, _ = _load(model, config, Path(path), budget)
            row["throughput_by_budget"][name] = {"budget_bytes": budget, "weight_bytes": counted,
                                                 "throughput": _throughput(model, m, tok)}
            del m
            gc.collect()
    return row


# ---- in the parent process


def _run_one(model: str, config: str, path: Path, work: Path) -> dict:
    code = ("import json, sys; from serve.bench.neuzip import measure; "
            "print('RESULT ' + json.dumps(measure(*sys.argv[1:])))")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code, model, config, str(path), str(work)], capture_output=True,
                          text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{model} {config} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1][len("RESULT "):])


def decode_speed(path: Path, repeats: int = 3) -> dict:
    """GB/s of bf16 written by the numba decoder over every coded tensor, on 1 thread and on all cores."""
    from kernels.neuzip_decode_cpu import neuzip_decode_numba

    f = NzpFile(path / NEUZIP_FILE)
    streams = [f.stream(n) for n, r in f.records.items() if r.codec == "neuzip"]
    out = torch.empty(max(s.numel for s in streams), dtype=torch.int16)
    total = sum(2 * s.numel for s in streams)
    res = {}
    for threads in (1, os.cpu_count() or 1):
        def run():
            for s in streams:
                neuzip_decode_numba(s.words, s.offsets, s.table, s.sm, s.bits, out[: s.numel], threads=threads)
        res[f"{threads}_thread{'s' if threads > 1 else ''}"] = total / median_time(run, repeats, warmup=True) / 1e9
    return res


def anchors(path: Path) -> dict:
    """Sizes, over the coded tensors' bf16 bytes: NeuZip's (headers and indexes included), the order-0 entropy of
    the exponents plus the raw sign and mantissa bits, and zstd -19 of the same bytes."""
    f = NzpFile(path / NEUZIP_FILE)
    coded = [r for r in f.records.values() if r.codec == "neuzip"]
    bf16 = sum(r.nbytes for r in coded)
    raw_blob = b"".join(f.tensor(r.name).view(torch.int16).numpy().tobytes() for r in coded)
    zstd = len(zstandard.ZstdCompressor(level=19, threads=-1).compress(raw_blob))
    exps = np.zeros(256, np.int64)
    order0 = 0.0
    from serve.codecs.entropy import order0_bits

    for r in coded:
        bits16 = f.tensor(r.name).view(torch.int16).numpy().view(np.uint16).reshape(-1)
        counts = np.bincount((bits16 >> 7) & 0xFF, minlength=256)
        exps += counts
        order0 += order0_bits(counts) / 8 + r.numel  # per-tensor exponent model, 8 raw bits
    size = path.joinpath(NEUZIP_FILE).stat().st_size - sum(r.nbytes for r in f.records.values() if r.codec == "raw")
    return {"coded_tensors": len(coded), "bf16_bytes": bf16, "neuzip_bytes": size, "neuzip": size / bf16,
            "order0": order0 / bf16, "zstd19": zstd / bf16,
            "exponent_entropy_bits": order0_bits(exps) / exps.sum()}


def run_neuzip_bench(out: Path, work: Path | None = None, steps_only: bool = False) -> dict:
    """steps_only: only the engine's forwards: split, and the frontier (serve/bench/neuzip_steps.py)."""
    from serve.bench.neuzip_steps import run_frontier, run_steps
    from serve.data.cache import home

    work = work or home() / "bench-neuzip"
    work.mkdir(parents=True, exist_ok=True)
    print("preparing bf16 and NeuZip copies of the models ...", flush=True)
    dirs = prepare(work)
    rows = []
    for model in MODELS if not steps_only else ():  # first: a child's peak RSS starts at this process's
        for config in CONFIGS:
            print(f"measuring {model} {config} ...", flush=True)
            rows.append(_run_one(model, config, dirs[model][config], work))
    print("engine forwards, bf16 and k7 taking turns ...", flush=True)
    steps = run_steps(dirs["smollm2"])
    print("frontier: bf16, int8 and k7 at each decoded share taking turns ...", flush=True)
    frontier = run_frontier(dirs["smollm2"])
    if steps_only:
        report = {"machine": machine(), "torch_threads": torch.get_num_threads(), "engine_steps_ms": steps,
                  "frontier": frontier}
        return finish(report, out, print_report)
    print("decode speed ...", flush=True)
    speed = {k: decode_speed(dirs["smollm2"][k]) for k in ("k7", "k3", "k0")}
    report = {"machine": machine(), "torch_threads": torch.get_num_threads(),
              "default_decoded_mib": NEUZIP_DECODED_MIB, "rows": rows,
              "anchors": {m: anchors(dirs[m]["k7"]) for m in MODELS},
              "decode_gb_per_s": speed, "engine_steps_ms": steps, "frontier": frontier,
              "gpu": NO_GPU}
    return finish(report, out, print_report)


def print_report(r: dict) -> None:
    from serve.bench.neuzip_steps import print_frontier, print_steps

    print(f"\nNeuZip on {r['machine']} ({r['torch_threads']} torch threads); default decoded-layer budget "
          f"{r.get('default_decoded_mib', NEUZIP_DECODED_MIB)} MiB")
    print_steps(r["engine_steps_ms"])
    print_frontier(r["frontier"])
    if "rows" not in r:
        return
    for model in MODELS:
        rows = [x for x in r["rows"] if x["model"] == model]
        base = rows[0]
        quality = "perplexity" if model == "smollm2" else "cosine to bf16 (mean / min)"
        unit = "gen tok/s" if model == "smollm2" else "enc tok/s"
        print(f"\n{model}: {quality}; {unit} at decoded-layer budget 0 and the default")
        print(f"{'config':<8}{'weights MiB':>12}{'RSS growth':>12}{'peak RSS':>10}{quality.split(' (')[0]:>16}"
              f"{'budget 0':>10}{'x bf16':>8}{'default':>10}{'x bf16':>8}")
        for x in rows:
            q = f"{x['perplexity']:.3f}" if model == "smollm2" else f"{x['cosine_mean']:.5f}/{x['cosine_min']:.4f}"
            t0 = x["throughput_budget0"]
            td = x.get("throughput_by_budget", {}).get("default", {}).get("throughput", t0)
            print(f"{x['config']:<8}{x['weight_bytes'] / MIB:>12.1f}{x['rss_growth_bytes'] / MIB:>12.1f}"
                  f"{x['peak_rss_bytes'] / MIB:>10.0f}{q:>16}{t0:>10.1f}{t0 / base['throughput_budget0']:>8.2f}"
                  f"{td:>10.1f}{td / base['throughput_budget0']:>8.2f}")
        k7 = next(x for x in rows if x["config"] == "k7")
        sweep = {k: v for k, v in k7.get("throughput_by_budget", {}).items() if k != "default"}
        if sweep:
            print("lossless, by decoded-layer budget (share of the coded weights kept decoded): " + ", ".join(
                f"{k} ({v['budget_bytes'] / MIB:.0f} MiB, weights {v['weight_bytes'] / MIB:.0f} MiB) "
                f"{v['throughput']:.1f} tok/s = {v['throughput'] / base['throughput_budget0']:.2f}x"
                for k, v in sweep.items()))
    print("\nsize of the coded tensors, over their bf16 bytes:")
    print(f"{'model':<10}{'tensors':>8}{'bf16 MB':>10}{'NeuZip k7':>11}{'order-0':>9}{'zstd -19':>10}{'exp bits':>10}")
    for model, a in r["anchors"].items():
        print(f"{model:<10}{a['coded_tensors']:>8}{a['bf16_bytes'] / 1e6:>10.1f}{a['neuzip']:>11.1%}"
              f"{a['order0']:>9.1%}{a['zstd19']:>10.1%}{a['exponent_entropy_bits']:>10.2f}")
    print("\ndecode (numba, SmolLM2's coded tensors), GB/s of bf16 written: " + "; ".join(
        f"{k}: " + ", ".join(f"{v:.2f} on {t.replace('_', ' ')}" for t, v in s.items())
        for k, s in r["decode_gb_per_s"].items()))
    print(f"GPU: {r['gpu']}")
