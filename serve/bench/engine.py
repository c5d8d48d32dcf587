"""`manyfold bench engine`: the engine's generation step and end-to-end generation, beside bare transformers and
PEFT's mixed batch, with the physical floor of a step on a GPU.

Decode step (one new token for each of N rows over a `context`-token prompt; N = 1, 16, 64): for transformers and
PEFT the median of `repeats` steps, each read back; for the engine, whose step is read while the next runs, the
time of `repeats` steps in a row over `repeats`, the median of three such runs:
  transformers     the bare base, eager, transformers' DynamicCache (cropped back after each step)
  engine base      the engine's step (serve/engine/generation/decode_batch.py: layout, forward, sampling, the one copy
  back),
                   every row on the base
  engine lora      one distinct rank-16 LoRA adapter on q_proj and v_proj per row
  engine mixed     rows in turn: the base, a LoRA adapter, a full fine-tune of the top two layers
  engine kinds     rows in turn: the base, a rank-16 LoRA on all seven linears (one each), a full fine-tune of the
                   top two layers (two distinct), a task of an EMR group of the top two layers (three tasks); its
                   floor counts every byte the kinds read (each adapter, both fine-tunes, tau_uni and the masks)
  peft mixed       PEFT's own mixed-batch forward (`adapter_names=`) with the same adapters as engine lora
The floor is the bytes a step must read, the weights once and every row's keys and values, over the GPU's
memory bandwidth (H100 3.35 TB/s, H200 4.8 TB/s).

End to end (every request submitted at once, greedy, no end-of-text stop so every system writes the same tokens):
  engine           Engine.complete for each request, through the scheduler, the cache and the adapter pool, the
                   adapters registered in a store as PEFT directories
  peft             PEFT's generate over static batches, each row with its own adapter (`adapter_names=`)
  transformers     the bare base's generate over static batches (what the base alone costs)
On a CPU, the packaged SmolLM2-135M-Instruct and the workload issue 34 names: 32 requests of 48 tokens over real
text, 16 adapters of ranks 8 and 16 on q_proj and v_proj, request i on adapter i % 16, static batches of 16;
every engine output is checked token for token against PEFT's. On CUDA, models built from their configs with
random weights (throughput does not depend on trained weights): SmolLM2-135M and Llama-3.2-1B shapes (Llama-3-8B
with --large), and end to end on the 1B shape: 128 requests of 128 prompt + 128 generated tokens over adapters
drawn by a power law from 100 registered.

Real traffic (--traffic; serve/bench/engine_traffic.py): requests arriving by a Poisson process at three rates up
to saturation, prompts as long as the packaged news articles, outputs of 16 to 256 tokens, every kind of row,
beside the same requests in lockstep: tokens/s, time to first token, time per output token, and the share of steps
and decode tokens that ran graphed.
"""

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from serve.bench.engine_models import (ALL_LINEARS, build_model_dir, emr_tasks, floor_ms, loaded_adapter,
                                       module_dims, peft_with, top2_finetune, top_layers, write_adapter)
from serve.bench.engine_e2e import CPU_WORKLOAD, GPU_WORKLOAD, bench_end_to_end
from serve.bench.engine_traffic import CPU_TRAFFIC, GPU_TRAFFIC, RATES, bench_traffic, print_traffic
from serve.bench.report import NO_GPU, finish, machine, median_time, sync

ROWS = (1, 16, 64)
RANK = 16
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
"""Bytes per second of HBM, by the name the device reports."""


# ---- one decode step
def median_ms(fn, repeats: int, device: torch.device) -> float:
    """report.median_time of fn with the device's work waited for."""
    return 1e3 * median_time(lambda: (fn(), sync(device)), repeats, warmup=True)


def steady_ms(step, repeats: int, device: torch.device, rounds: int = 3) -> float:
    """A step's time in steady state: `repeats` steps in a row, one wait at the end, over the steps; the median of
    `rounds`. The engine reads each step while the next runs on the device, so timing one step with a wait after
    it would add the next one's."""
    step()
    sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        sync(device)
        times.append((time.perf_counter() - t0) / repeats)
    return 1e3 * statistics.median(times)


def engine_step_ms(rt, variants: list, context: int, repeats: int, seed: int, profile: list | None = None) -> float:
    """The engine's decode step over len(variants) rows (None: the base), each at `context` tokens. profile: a
    list to append the operations (CPU) or kernels (CUDA) of `repeats` more steps to, by total time."""
    from serve.engine.generation.decode_batch import DecodeBatch
    from serve.engine.generation.row import NewRow
    from serve.engine.types import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = rt.model.config.vocab_size
    rows = [NewRow(i, torch.randint(3, vocab, (context,), generator=g).tolist(),
                   SamplingParams(max_tokens=1 << 20), v) for i, v in enumerate(variants)]
    batch = DecodeBatch(rt)
    eos, rt.eos_ids = rt.eos_ids, set()
    try:
        batch.run(rows)
        while batch.prefilling:
            batch.run([])
        ms = steady_ms(lambda: batch.run([]), repeats, rt.device)
        if profile is not None:
            profile += profiled(lambda: batch.run([]), repeats, rt.device)
        return ms
    finally:
        batch.close()
        rt.eos_ids = eos


def profiled(step, repeats: int, device: torch.device, top: int = 30) -> list[dict]:
    """The `top` operations or kernels of `repeats` steps by their total self time on the device (CUDA) or the host:
    where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "calls_per_step": e.count / repeats, "us_per_step": getattr(e, key) / repeats}
            for e in events]


def hf_step_ms(model, rows: int, context: int, repeats: int, device: torch.device, **kwargs) -> float:
    """One decode step of a transformers model (bare or PEFT) over a DynamicCache of `context` tokens a row."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (rows, context), device=device)
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs)
        nxt = out.logits[:, -1:].argmax(-1)

        def step():
            o = model(input_ids=nxt, past_key_values=cache, use_cache=True, **kwargs)
            cache.crop(-1)  # back to the context: every timed step is the same step
            return o.logits[:, -1].argmax(-1).tolist()

        return median_ms(step, repeats, device)


def bench_steps(model_dir: Path, device: torch.device, context: int, repeats: int, bandwidth: float | None,
                rows_list=ROWS, profile: bool = False, neuzip: bool = True) -> list[dict]:
    """profile: the adapters' and the four kinds' steps at the most rows also profiled (its entry's "profile" and
    "profile_kinds"); neuzip: on CUDA, the
    same rows on the base held as NeuZip (neuzip_step), whose compression runs on the host first."""
    from transformers import AutoModelForCausalLM

    from serve.config import BatchConfig, SlotsConfig
    from serve.engine.model import BaseModelRuntime

    most = max(rows_list)
    rt = BaseModelRuntime("bench", model_dir, str(device), SlotsConfig(adapter_mib=4096, weights_mib=4096,
                                                                       max_rank=64),
                          batch=BatchConfig(max_batch_size=most, max_model_len=context + 4 * repeats + 16,
                                            max_step_tokens=8192))
    dims = module_dims(model_dir)
    dtype = next(rt.model.parameters()).dtype
    adapters = [loaded_adapter(f"a{i}", dims, RANK, i, dtype, device) for i in range(most)]
    every = module_dims(model_dir, ALL_LINEARS)
    wide = [loaded_adapter(f"w{i}", every, RANK, 500 + i, dtype, device) for i in range(-(-most // 4))]
    fulls = [top2_finetune(rt, f"f{i}", i) for i in range(2)]
    tasks = emr_tasks(rt, "bench-emr", 3, 7, top_layers(rt))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    rows_out = []
    for rows in rows_list:
        mixed = [(None, adapters[i], fulls[i % 2])[i % 3] for i in range(rows)]
        kinds = [(None, wide[i // 4], fulls[(i // 4) % 2], tasks[(i // 4) % 3])[i % 4] for i in range(rows)]
        kernels, kinds_kernels = ([], []) if profile and rows == most else (None, None)
        entry = {"rows": rows, "context": context, "floor_ms": floor_ms(rt, rows, context, bandwidth),
                 "transformers_ms": hf_step_ms(plain, rows, context, repeats, device),
                 "engine_base_ms": engine_step_ms(rt, [None] * rows, context, repeats, rows),
                 "engine_lora_ms": engine_step_ms(rt, adapters[:rows], context, repeats, rows, kernels),
                 "engine_mixed_ms": engine_step_ms(rt, mixed, context, repeats, rows),
                 "engine_kinds_ms": engine_step_ms(rt, kinds, context, repeats, rows, kinds_kernels),
                 "kinds_floor_ms": floor_ms(rt, rows, context, bandwidth, kinds)}
        rows_out.append(entry)
        print(f"  {rows} rows: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items()})}",
              flush=True)
        if kernels is not None:
            entry["profile"], entry["profile_kinds"] = kernels, kinds_kernels
    steps = dict(rt.step_counts)
    if device.type == "cuda" and neuzip:
        rows_out[-1]["neuzip"] = neuzip_step(model_dir, rt, adapters[:most], context, repeats, rows_out[-1])
    with_peft = peft_steps(plain, rt, adapters, rows_list, context, repeats, device, model_dir)
    for entry, peft in zip(rows_out, with_peft):
        entry["peft_mixed_ms"] = peft
        entry["steps"] = steps
    if rt.graphs is not None:
        for entry in rows_out:
            entry["graphs"] = {"captures": rt.graphs.captures, "capture_s": round(rt.graphs.capture_seconds, 2),
                               "capture_mib": round(rt.graphs.capture_bytes / (1 << 20), 1)}
    return rows_out


def neuzip_step(model_dir: Path, bf16, adapters: list, context: int, repeats: int, entry: dict) -> dict:
    """The same LoRA rows on the base held as a lossless NeuZip base (256-symbol lanes, as a GPU server stores it):
    its graphed step beside its decode measured alone plus the bf16 base's step (entry's engine_lora_ms), the
    decoder's speed, and the memory it saves."""
    from serve.codecs.neuzip import LANE_GPU
    from serve.codecs.neuzip_file import compress_dir
    from serve.config import BatchConfig, SlotsConfig
    from serve.engine.model import BaseModelRuntime
    from kernels import neuzip_decode_group

    nz_dir = model_dir.with_name(model_dir.name + "-nz7")
    if not (nz_dir / "config.json").exists():
        compress_dir(model_dir, 7, nz_dir, lane=LANE_GPU)
    rt = BaseModelRuntime("bench-nz", nz_dir, str(bf16.device), SlotsConfig(adapter_mib=4096, max_rank=64),
                          batch=BatchConfig(max_batch_size=len(adapters), max_model_len=bf16.kv.positions,
                                            max_step_tokens=8192))
    step_ms = engine_step_ms(rt, adapters, context, repeats, 0)
    decoder = rt.coded.decoder

    def decode_all():
        for group in decoder.groups:
            neuzip_decode_group(group)

    decode_ms = steady_ms(decode_all, repeats, rt.device)
    decoded = rt.coded.decoded_size
    saved = sum(p.numel() * p.element_size() for p in bf16.model.parameters()) - rt.nbytes
    adapter = sum(t.numel() * t.element_size() for t in adapters[0].tensors.values())
    slot = bf16.kv.position_bytes * bf16.kv.positions  # a row of the whole context
    out = {"step_ms": step_ms, "decode_ms": decode_ms, "bf16_step_ms": entry["engine_lora_ms"],
           "step_over_decode_plus_bf16": step_ms / (decode_ms + entry["engine_lora_ms"]),
           "decoder_gb_s": decoded / decode_ms / 1e6, "decoded_gb": decoded / 1e9, "saved_gb": saved / 1e9,
           "saved_holds_rows": saved // slot, "saved_holds_adapters": saved // adapter,
           "steps": dict(rt.step_counts)}
    del rt
    return out


def peft_steps(plain, rt, adapters, rows_list, context, repeats, device, model_dir) -> list[float]:
    """PEFT's mixed-batch decode step with the engine's adapters (written as PEFT directories once)."""
    import tempfile

    dims = module_dims(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {a.name: write_adapter(Path(tmp) / a.name, dims, RANK, i) for i, a in enumerate(adapters)}
        model = peft_with(plain, dirs).to(device)
        out = []
        for rows in rows_list:
            names = [adapters[i].name for i in range(rows)]
            out.append(hf_step_ms(model, rows, context, repeats, device, adapter_names=names))
        model.unload()
    return out


# ---- the command
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        import triton

        return (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / (1 << 30):.0f} GiB; "
                f"torch {torch.__version__}, Triton {triton.__version__}")
    return machine()


def bandwidth_of(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def run_engine_bench(out: Path, work: Path, device: str = "cpu", large: bool = False, repeats: int = 21,
                     context: int | None = None, shapes: list[str] | None = None, e2e: bool = True,
                     rounds: int | None = None, steps: bool = True, profile: bool = False, traffic: bool = False,
                     traffic_requests: int | None = None, neuzip: bool = True,
                     traffic_rates: tuple[float, ...] = RATES, kv_layouts: tuple[str, ...] = ("slots", "paged"),
                     system_prompt_tokens: int = 0, traffic_rounds: int = 1) -> dict:
    """rounds: of the end-to-end systems in turn (default 3 on a CPU, 1 on CUDA); steps: the decode-step table;
    profile: the adapters' and the four kinds' steps at 64 rows profiled for each shape (printed, and in the JSON);
    traffic: the real-traffic runs (traffic_requests: how many requests, instead of the workload's; traffic_rates:
    the Poisson runs' rates, fractions of lockstep's; kv_layouts: the KV layouts each is run in;
    system_prompt_tokens: each model's requests behind a system prompt of its own that long; traffic_rounds:
    lockstep runs of each layout, in turn); neuzip: on CUDA, each shape's NeuZip row (compressing Llama-3-8B's
    shape takes minutes of the host)."""
    dev = torch.device(device)
    work.mkdir(parents=True, exist_ok=True)
    bandwidth = bandwidth_of(dev)
    report: dict = {"machine": device_name(dev), "device": device, "steps": {}, "end_to_end": None, "traffic": None,
                    "gpu": None if dev.type == "cuda" else NO_GPU}
    workload = CPU_TRAFFIC if dev.type == "cpu" else GPU_TRAFFIC
    if traffic_requests:
        workload = replace(workload, requests=traffic_requests)
    if dev.type == "cpu":
        from serve.data.models import smollm2_dir

        torch.set_num_threads(2)
        ctx = context or 128
        if steps:
            report["steps"]["smollm2-135m (packaged, fp32)"] = bench_steps(smollm2_dir(), dev, ctx, repeats, None,
                                                                           profile=profile)
        if e2e:
            report["end_to_end"] = bench_end_to_end(smollm2_dir(), work / "e2e-cpu", dev, CPU_WORKLOAD, (8, 16),
                                                    None, rounds or 3)
        if traffic:
            report["traffic"] = bench_traffic(smollm2_dir(), work / "traffic-cpu", dev, workload,
                                              rates=traffic_rates, layouts=kv_layouts,
                                              system_prompt_tokens=system_prompt_tokens, rounds=traffic_rounds)
    else:
        ctx = context or 512
        names = shapes or ["smollm2-135m", "llama-3.2-1b"] + (["llama-3-8b"] if large else [])
        for shape in names if steps else []:
            print(f"{shape}: building", flush=True)
            d = build_model_dir(shape, work / shape, dev)
            report["steps"][shape] = bench_steps(d, dev, ctx, repeats, bandwidth, profile=profile, neuzip=neuzip)
        if e2e:
            d = build_model_dir("llama-3.2-1b", work / "llama-3.2-1b", dev)
            report["end_to_end"] = bench_end_to_end(d, work / "e2e-1b", dev, GPU_WORKLOAD, (RANK,), 1, rounds or 1)
        if traffic:
            d = build_model_dir("llama-3.2-1b", work / "llama-3.2-1b", dev)
            report["traffic"] = bench_traffic(d, work / "traffic-1b", dev, workload, bandwidth, traffic_rates,
                                              kv_layouts, system_prompt_tokens, traffic_rounds)
    return finish(report, out, print_report)


def print_steps(report: dict) -> None:
    print("\none decode step, ms (engine: steady state; others: median); floor: weights + KV bytes over HBM bandwidth")
    print(f"{'shape':<32}{'rows':>5}{'floor':>8}{'transformers':>14}{'engine base':>13}{'engine lora':>13}"
          f"{'lora/base':>10}{'engine mixed':>14}{'engine kinds':>14}{'its floor':>11}{'peft mixed':>12}")
    for shape, rows in report["steps"].items():
        for r in rows:
            floor = f"{r['floor_ms']:.2f}" if r.get("floor_ms") else "n/a"
            kinds_floor = f"{r['kinds_floor_ms']:.2f}" if r.get("kinds_floor_ms") else "n/a"
            print(f"{shape:<32}{r['rows']:>5}{floor:>8}{r['transformers_ms']:>14.2f}{r['engine_base_ms']:>13.2f}"
                  f"{r['engine_lora_ms']:>13.2f}{r['engine_lora_ms'] / r['engine_base_ms']:>9.2f}x"
                  f"{r['engine_mixed_ms']:>14.2f}{r['engine_kinds_ms']:>14.2f}{kinds_floor:>11}"
                  f"{r['peft_mixed_ms']:>12.2f}")
    for shape, rows in report["steps"].items():
        nz = rows[-1].get("neuzip")
        if nz:
            print(f"\n{shape}, {rows[-1]['rows']} LoRA rows on a lossless NeuZip base: a step {nz['step_ms']:.2f} ms "
                  f"against its decode alone {nz['decode_ms']:.2f} + the bf16 step {nz['bf16_step_ms']:.2f} "
                  f"({nz['step_over_decode_plus_bf16']:.2f}x); the decoder {nz['decoder_gb_s']:.0f} GB/s of "
                  f"decoded weights; it saves {nz['saved_gb']:.2f} GB, room for {nz['saved_holds_rows']} more rows of "
                  f"max_model_len or {nz['saved_holds_adapters']} more adapters like these")
    for shape, rows in report["steps"].items():
        for r in rows:
            for key, rows_hold in (("profile", "adapters"), ("profile_kinds", "the four kinds in turn")):
                if r.get(key):
                    print(f"\n{shape}, {r['rows']} rows with {rows_hold}: where a step goes (us a step, calls a step)")
                    for k in r[key]:
                        print(f"  {k['us_per_step']:>9.1f} {k['calls_per_step']:>7.1f}  {k['name'][:90]}")


def print_report(report: dict) -> None:
    print(f"\nengine bench on {report['machine']}")
    if report["gpu"]:
        print(f"GPU: {report['gpu']}")
    if report["steps"]:
        print_steps(report)
    e = report.get("end_to_end")
    if e:
        print(f"\nend to end: {e['requests']} requests of {e['new_tokens']} new tokens (prompts "
              f"{e['prompt_tokens'][0]}-{e['prompt_tokens'][1]} tokens), {e['adapters_used']} of "
              f"{e['adapters_registered']} adapters used; static batches of {e['static_batch']}; medians of "
              f"{e.get('rounds', 1)} rounds, the systems taking turns")
        print(f"  engine, adapters      {e['engine_tok_s']:>9.1f} tokens/s   (outputs equal PEFT's: "
              f"{e['engine_equal_peft']})")
        print(f"  engine, base rows     {e['engine_base_tok_s']:>9.1f} tokens/s")
        print(f"  engine, adapters, {e['engine_wide_rows']} rows a step {e['engine_wide_tok_s']:>9.1f} tokens/s   "
              f"(outputs equal PEFT's: {e['engine_wide_equal_peft']})")
        print(f"  transformers, base    {e['transformers_tok_s']:>9.1f} tokens/s")
        print(f"  peft mixed batch      {e['peft_tok_s']:>9.1f} tokens/s   ({e['peft_requests_timed']} requests timed)")
        print(f"  engine / peft {e['engine_tok_s'] / e['peft_tok_s']:.2f}x, engine / transformers "
              f"{e['engine_tok_s'] / e['transformers_tok_s']:.2f}x; steps {e['engine_steps']}")
    if report.get("traffic"):
        print_traffic(report["traffic"])
