"""Train a LoRA or PiSSA adapter on a causal LM with peft, and write it in the form the server loads.

base dir + JSONL -> out_dir/{adapter_config.json, adapter_model.safetensors, train_log.json}; a PiSSA
adapter is written converted (rank 2r, relative to the original base), never raw.
"""

import functools
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.adapters.data import TrainExample, collate, read_jsonl, tokenize_examples
from serve.adapters.load import compute_device, model_dtype, on_device, peft_quietly, with_adapter
from serve.adapters.validation import EarlyStopping
from serve.errors import ConfigError
from serve.store.writer import atomic_dir
from serve.variants.lora import ADAPTER_CONFIG

INITIAL = "pissa_initial"
"""Subfolder of the staging dir holding the untrained PiSSA adapter; peft names the adapter after it."""
LOG_FILE = "train_log.json"
Progress = Callable[[int, float], None]
"""Called after each step with (step, loss); without one, a tqdm bar shows the loss."""
LossOf = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    losses: list[float]
    init_seconds: float
    """Loading the base and building the peft model, the SVDs of a PiSSA init included."""
    train_seconds: float
    trainable_params: int


def init_lora_weights(init: str) -> str | bool:
    """The peft `init_lora_weights` of an init name: "lora" -> True (A Kaiming, B = 0), "pissa", "pissa_niter_K"."""
    if init == "lora":
        return True
    if init == "pissa" or re.fullmatch(r"pissa_niter_[1-9][0-9]*", init):
        return init
    raise ConfigError(f"init must be 'lora', 'pissa' or 'pissa_niter_K', got {init!r}")


def make_peft_model(base_dir: str | Path, init: str, rank: int, alpha: float | None = None,
                    target_modules: str | list[str] = "all-linear", seed: int = 0):
    """(peft model, tokenizer): the base (fp32 on a CPU, bf16 on a GPU: load.model_dtype) with a fresh adapter,
    scale s = alpha / rank (alpha = rank).

    A PiSSA init replaces each target W by W_res = W - s B0 A0 with B0 A0 its top-rank SVD part, so the
    model's output is unchanged before training.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if rank < 1:
        raise ConfigError(f"rank must be >= 1, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=target_modules,
                        init_lora_weights=init_lora_weights(init), lora_dropout=0.0, task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=model_dtype()).to(compute_device())
    torch.manual_seed(seed)  # Kaiming A of a LoRA init, the random projections of pissa_niter_K
    with peft_quietly():
        return get_peft_model(model, config), tokenizer


def adapter_model(base_dir: str | Path, adapter_dir: str | Path):
    """(peft model, tokenizer): the base (load.model_dtype) with the LoRA adapter at adapter_dir, trainable from where it
    is (a Trans-LoRA student that starts from the source adapter, where it fits the target)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=model_dtype()).to(compute_device())
    return with_adapter(model, adapter_dir, trainable=True), AutoTokenizer.from_pretrained(base_dir)


def batches(features: list[dict[str, list[int]]], batch_size: int, seed: int,
            pad_token_id: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches: each epoch is a seeded permutation of the examples, cut into batch_size chunks."""
    gen = torch.Generator().manual_seed(seed)
    n = min(batch_size, len(features))
    while True:
        order = torch.randperm(len(features), generator=gen).tolist()
        for start in range(0, len(order) - n + 1, n):  # an epoch's remainder is dropped, never a short batch
            yield collate([features[i] for i in order[start:start + n]], pad_token_id)


def train_steps(model, data: Iterator[dict[str, torch.Tensor]], steps: int, lr: float,
                progress: Progress | None = None, desc: str = "train",
                should_stop: Callable[[int, bool], bool] | None = None, loss_of: LossOf | None = None
                ) -> list[dict[str, float]]:
    """AdamW (no weight decay) on the trainable params, cosine schedule after a 10% warmup, grad norm <= 1.
    should_stop(step, last) is asked after each step: True ends training there (early stopping). loss_of(model,
    batch): the loss to follow (a distillation's, serve/adapters/distill.py); by default the cross-entropy of the
    labels."""
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(opt, steps // 10, steps)
    log = []
    model.train()
    with tqdm(total=steps, desc=desc, disable=progress is not None) as bar:
        for step in range(1, steps + 1):
            step_lr = schedule.get_last_lr()[0]
            batch = on_device(next(data), model)
            loss = model(**batch).loss if loss_of is None else loss_of(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            log.append({"step": step, "loss": loss.item(), "lr": step_lr})
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
            if progress is not None:
                progress(step, loss.item())
            if should_stop is not None and should_stop(step, step == steps):
                break
    model.eval()
    return log


def _until(out_of_time: Callable[[], bool], then: Callable[[int, bool], bool] | None) -> Callable[[int, bool], bool]:
    """should_stop that also ends training once out_of_time() says so, `then` told it is the last step."""
    def should_stop(step: int, last: bool) -> bool:
        over = out_of_time()
        return bool(then is not None and then(step, last or over)) or over
    return should_stop


def save_servable(model, out_dir: Path, initial: Path | None) -> None:
    """peft's save_pretrained, converting a PiSSA adapter against `initial`; target_modules sorted so that
    equal runs write equal bytes (peft writes them from a set)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PiSSA changes the base weights")  # we are converting it
        conversion = None if initial is None else str(initial)
        model.save_pretrained(out_dir, path_initial_model_for_weight_conversion=conversion)
    path = out_dir / ADAPTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def train_adapter(base_dir: str | Path, data: str | Path | list[TrainExample], out_dir: str | Path,
                  init: str = "pissa", rank: int = 16, alpha: float | None = None, steps: int = 100,
                  lr: float = 2e-4, batch_size: int = 4, max_length: int = 128,
                  target_modules: str | list[str] = "all-linear", seed: int = 0,
                  progress: Progress | None = None, early_stopping: EarlyStopping | None = None,
                  start_from: str | Path | None = None, loss_of: LossOf | None = None,
                  out_of_time: Callable[[], bool] | None = None) -> TrainResult:
    """Train an adapter on base_dir and write its servable form to out_dir (atomically, a fresh directory).

    For a PiSSA init the untrained adapter (A0, B0) is saved in the staging dir, and peft's
    `save_pretrained(path_initial_model_for_weight_conversion=...)` writes the rank-2r LoRA
    ΔW = s [B1 | -B0] [A1 ; A0] on the original base (serve.adapters.convert.convert_pissa does the same).
    With early_stopping, the adapter written is the one at its best validation, and the log holds the curve.
    start_from: a LoRA adapter directory of this base's shapes to train on from (init and rank are then its own);
    loss_of: what to minimise (train_steps). out_of_time: asked after each step; True ends training there (the
    point validated first, where early_stopping is given).
    """
    examples = read_jsonl(data) if isinstance(data, (str, Path)) else data
    if not examples or steps < 1 or batch_size < 1:
        raise ConfigError(f"need examples, steps >= 1 and batch_size >= 1; got {len(examples)} examples, "
                          f"{steps} steps, batch_size {batch_size}")
    with atomic_dir(out_dir) as stage:
        t0 = time.perf_counter()
        if start_from is None:
            model, tok = make_peft_model(base_dir, init, rank, alpha, target_modules, seed)
        else:
            model, tok = adapter_model(base_dir, start_from)
            init, rank, alpha = "adapter", model.peft_config["default"].r, model.peft_config["default"].lora_alpha
        init_seconds = time.perf_counter() - t0
        initial = stage / INITIAL if init not in ("lora", "adapter") else None
        if initial is not None:
            model.save_pretrained(initial)
        features = tokenize_examples(tok, examples, max_length)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        t0 = time.perf_counter()
        stop = None
        if early_stopping is not None:
            early_stopping.check(model, 0)
            stop = functools.partial(early_stopping.check, model)
        if out_of_time is not None:
            stop = _until(out_of_time, stop)
        log = train_steps(model, batches(features, batch_size, seed, pad), steps, lr, progress, f"{init} r={rank}",
                          stop, loss_of)
        if early_stopping is not None:
            early_stopping.restore(model)
        train_seconds = time.perf_counter() - t0
        save_servable(model, stage, initial)
        if initial is not None:
            shutil.rmtree(initial)
        (stage / "README.md").unlink(missing_ok=True)  # peft's model card: paths and versions, not the adapter
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        summary = {"init": init, "start_from": None if start_from is None else str(start_from), "rank": rank,
                   "alpha": rank if alpha is None else alpha, "steps": steps,
                   "lr": lr, "batch_size": batch_size, "max_length": max_length, "seed": seed,
                   "target_modules": target_modules, "examples": len(examples), "trainable_params": trainable,
                   "init_seconds": init_seconds, "seconds": train_seconds, "log": log}
        if early_stopping is not None:
            summary["validation"] = {"curve": early_stopping.curve, "best_step": early_stopping.best_step}
        (stage / LOG_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return TrainResult(Path(out_dir), [e["loss"] for e in log], init_seconds, train_seconds, trainable)
