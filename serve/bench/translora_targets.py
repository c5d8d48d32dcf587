"""The Trans-LoRA bench's target bases, each built once under its work dir: SmolLM2 after NeuZip k=0, and a new
version of SmolLM2 continued-trained on text none of the bench's tasks uses.

`neuzip-k0`: every weight rounded to a power of two (NeuZip, no mantissa bits), decoded back to a plain model.
`new-version`: SmolLM2-135M-Instruct trained on, next token, Debian's fortunes (train split; the tasks use SMS,
BBC news and tweets), as a new release trained on more text would be. Each build writes its recipe, seconds and
held-out perplexities before and after to TARGET_FILE beside the model.

The recipe (NEW_VERSION), measured when chosen on a busy 2-core CPU (`python -m serve.bench.translora_targets`,
22 minutes; perplexity on 100 held-out texts per corpus, source -> new version): fortunes 100.1 -> 57.2 (-43%),
BBC news 38.8 -> 39.9 (+3%), tweets 285 -> 322 (+13%): it has learnt its new text and is still a sensible LM
(its greedy continuation of a news opening is plain news prose). The bench's headlines source adapter (seed 0)
applied unchanged: held-out loss 2.922 a token on the source, 3.126 on the new version (the new version alone
5.666, the source alone 5.285): it still helps, but fits 0.20 nats a token worse. At lr 5e-4 (the rest the
same) the adapter fitted worse still (3.497, alone 5.965), but the base had lost ground everywhere (news +17%,
tweets +38%, and fortunes only 62.0, behind 2e-4's 57.2): a damaged model more than a new one, so 2e-4 was
kept. Top 10 layers, not all 30, to fit the time: all 30 cost 8.7 s a step here against 3.8 s for 10 (9-step
probes on the same busy machine).
"""

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from serve.demo import LmTask, finetune_lm_top_layers
from serve.errors import ConfigError
from serve.store.writer import atomic_dir

TARGETS = ("neuzip-k0", "new-version", "deeper", "deeper-5", "wider")
TARGET_FILE = "target.json"
NEW_VERSION = LmTask("smollm2-fortunes-v2", "fortunes", steps=300, top_layers=10, batch_size=8, max_len=64,
                     lr=2e-4)
"""The top 10 of 30 decoder layers and the final norm, 300 steps of 8 quotes (at most 64 tokens), AdamW at 2e-4."""
DEEPER = LmTask("smollm2-deeper", "fortunes", steps=240, top_layers=24, batch_size=8, max_len=64, lr=2e-4)
"""SmolLM2 grown to 33 layers (INSERT_AFTER), then its top 24 layers (the three new ones among them) and final
norm trained on fortunes: 240 steps of 8 quotes (at most 64 tokens), AdamW at 2e-4."""
INSERT_AFTER = (9, 15, 21)
"""Source layers after which a new layer is inserted (counted in the source): each new layer a copy of the one
before it whose output projections (o_proj, down_proj) are zero, so that the grown model computes exactly what
SmolLM2 does until it is trained, and every layer name from 10 on is shifted (an old adapter's layers.12 lands
on what was layers.11)."""
DEEPER_5 = LmTask("smollm2-deeper-5", "fortunes", steps=240, top_layers=32, batch_size=8, max_len=64, lr=2e-4)
"""SmolLM2 grown to 35 layers (INSERT_AFTER_5: other places, other numbers), then its top 32 layers (every new one
among them) and final norm trained as DEEPER's."""
INSERT_AFTER_5 = (2, 8, 14, 20, 26)
WIDER = LmTask("smollm2-wider", "fortunes", steps=240, top_layers=30, batch_size=8, max_len=64, lr=2e-4)
"""SmolLM2 with every MLP widened to WIDER_MLP (widen), then all 30 layers and the final norm trained as DEEPER's."""
WIDER_MLP = 2048
"""The widened MLPs' intermediate size (SmolLM2's is 1536)."""
PPL_TEXTS = 100
"""Held-out texts per corpus for a perplexity (each cut to 128 tokens)."""
DESCRIPTIONS = {"neuzip-k0": "SmolLM2-135M-Instruct after NeuZip k=0",
                "new-version": f"SmolLM2-135M-Instruct continued-trained on fortunes ({NEW_VERSION.steps} steps, "
                               f"top {NEW_VERSION.top_layers} layers, lr {NEW_VERSION.lr})",
                "deeper": f"SmolLM2-135M-Instruct grown to 33 layers (one inserted after layers "
                          f"{', '.join(map(str, INSERT_AFTER))}, zero output projections), then its top "
                          f"{DEEPER.top_layers} layers trained on fortunes ({DEEPER.steps} steps, lr {DEEPER.lr})",
                "deeper-5": f"SmolLM2-135M-Instruct grown to 35 layers (one inserted after layers "
                            f"{', '.join(map(str, INSERT_AFTER_5))}, zero output projections), then its top "
                            f"{DEEPER_5.top_layers} layers trained on fortunes ({DEEPER_5.steps} steps, lr "
                            f"{DEEPER_5.lr})",
                "wider": f"SmolLM2-135M-Instruct with MLPs widened from 1536 to {WIDER_MLP} (new neurons: copies of "
                         f"existing ones, their down projections zero), then all {WIDER.top_layers} layers trained on "
                         f"fortunes ({WIDER.steps} steps, lr {WIDER.lr})"}


def heldout_texts(corpus: str, n: int = PPL_TEXTS) -> list[str]:
    """The first n texts (by hash) of a corpus's test split: "fortunes" (the new version's training corpus),
    "news" (BBC article bodies) or "tweets"."""
    from serve.adapters.tasks import bbc_articles, by_hash
    from serve.data.datasets import fortunes, tweet_sentiment

    if corpus == "fortunes":
        texts = fortunes("test")
    elif corpus == "news":
        texts = [body for _, body in bbc_articles("test")]
    elif corpus == "tweets":
        texts = [e.text for e in tweet_sentiment("test").examples]
    else:
        raise ConfigError(f"unknown corpus {corpus!r}; known: fortunes, news, tweets")
    return by_hash(sorted(set(texts)), str)[:n]


PPL_CORPORA = ("fortunes", "news", "tweets")


@torch.no_grad()
def perplexities(base_dir: Path, corpora: tuple[str, ...] = PPL_CORPORA) -> dict[str, float]:
    """Held-out perplexity per corpus: exp of the mean next-token loss over every token of its texts."""
    from serve.adapters.data import TextExample
    from serve.adapters.load import load_lm
    from serve.adapters.validation import completion_loss

    model, tok = load_lm(base_dir)
    return {c: math.exp(completion_loss(model, tok, [TextExample(text=t) for t in heldout_texts(c)]))
            for c in corpora}


def neuzip_k0_base(work: Path) -> Path:
    """SmolLM2 after NeuZip k=0, as a plain HF directory."""
    from serve.codecs.neuzip_file import compress_dir, decompress_dir
    from serve.data.models import smollm2_dir

    out = work / "smollm2-k0"
    if not (out / "config.json").exists():
        compress_dir(smollm2_dir(), 0, work / "smollm2-k0.nzp-dir")
        decompress_dir(work / "smollm2-k0.nzp-dir", out)
    return out


def new_version_base(work: Path, log: Callable[[str], None] = print) -> Path:
    """SmolLM2 continued-trained by NEW_VERSION on the fortunes' train split."""
    from serve.data.models import smollm2_dir

    return _trained_base(smollm2_dir(), work / NEW_VERSION.variant, NEW_VERSION, "new-version", log)


def deeper_base(work: Path, log: Callable[[str], None] = print, name: str = "deeper") -> Path:
    """SmolLM2 grown by INSERT_AFTER (deeper-5: INSERT_AFTER_5), then trained by DEEPER (DEEPER_5) on the fortunes'
    train split."""
    from serve.data.models import smollm2_dir

    after, recipe = (INSERT_AFTER, DEEPER) if name == "deeper" else (INSERT_AFTER_5, DEEPER_5)
    grown = work / ("smollm2-grown" if name == "deeper" else f"smollm2-grown-{len(after)}")
    if not (grown / "config.json").is_file():
        with atomic_dir(grown, replace=True) as stage:
            grow(smollm2_dir(), stage, after)
    return _trained_base(grown, work / recipe.variant, recipe, name, log)


def wider_base(work: Path, log: Callable[[str], None] = print) -> Path:
    """SmolLM2 widened to WIDER_MLP, then trained by WIDER on the fortunes' train split."""
    from serve.data.models import smollm2_dir

    widened = work / f"smollm2-mlp{WIDER_MLP}"
    if not (widened / "config.json").is_file():
        with atomic_dir(widened, replace=True) as stage:
            widen(smollm2_dir(), stage, WIDER_MLP)
    return _trained_base(widened, work / WIDER.variant, WIDER, "wider", log)


def widen(base_dir: Path, out_dir: Path, intermediate: int) -> None:
    """Write base_dir's model with every gated MLP `intermediate` wide: each new neuron a copy of an existing one
    (its gate and up rows) whose down projection column is zero, so that the model computes what it did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    old = model.config.intermediate_size
    if intermediate <= old:
        raise ConfigError(f"widen to {intermediate}: the MLPs are {old} wide already")
    copies = torch.arange(intermediate - old) % old
    for layer in model.model.layers:
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):
            w = getattr(mlp, name).weight.data
            setattr(mlp, name, _linear(torch.cat([w, w[copies]])))
        down = mlp.down_proj.weight.data
        mlp.down_proj = _linear(torch.cat([down, torch.zeros(down.shape[0], intermediate - old)], dim=1))
    model.config.intermediate_size = intermediate
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free linear layer holding `weight` [out, in]."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight.contiguous()
    return layer


def grow(base_dir: Path, out_dir: Path, insert_after: tuple[int, ...]) -> None:
    """Write base_dir's model with a new decoder layer after each of `insert_after`'s layers: a copy of that layer
    whose output projections are zero, so that its residual adds nothing and the model computes what it did."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    layers = []
    for i, layer in enumerate(model.model.layers):
        layers.append(layer)
        if i in insert_after:
            new = copy.deepcopy(layer)
            torch.nn.init.zeros_(new.self_attn.o_proj.weight)
            torch.nn.init.zeros_(new.mlp.down_proj.weight)
            layers.append(new)
    for j, layer in enumerate(layers):
        layer.self_attn.layer_idx = j
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[0]] * len(layers)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)


def _trained_base(start: Path, out: Path, recipe: LmTask, name: str, log: Callable[[str], None]) -> Path:
    """`start` trained by `recipe` (its top layers, next token, on the fortunes' train split), with its tokenizer
    and TARGET_FILE (the recipe, the seconds and the held-out perplexities of SmolLM2 and of the result), written
    atomically; kept while its recorded recipe is `recipe`."""
    from serve.data.datasets import fortunes
    from serve.data.models import smollm2_dir

    if (out / TARGET_FILE).is_file() and json.loads((out / TARGET_FILE).read_text())["recipe"] == asdict(recipe):
        return out  # built by this recipe; another recipe's build is replaced
    log(f"building {out.name}: {DESCRIPTIONS[name]}")
    before = perplexities(smollm2_dir())
    with atomic_dir(out, replace=True) as stage:
        t0 = time.perf_counter()
        last = finetune_lm_top_layers(start, fortunes("train"), stage, recipe, log=log)
        seconds = time.perf_counter() - t0
        after = perplexities(stage)
        info = {"recipe": asdict(recipe), "corpus": "fortunes (train split)", "last_loss": last,
                "train_seconds": seconds, "perplexity": {"before": before, "after": after}}
        (stage / TARGET_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out


def target_base(name: str, work: Path, log: Callable[[str], None] = print) -> Path:
    """A target base by name (TARGETS), built under work if missing."""
    if name == "neuzip-k0":
        return neuzip_k0_base(work)
    if name == "new-version":
        return new_version_base(work, log)
    if name in ("deeper", "deeper-5"):
        return deeper_base(work, log, name)
    if name == "wider":
        return wider_base(work, log)
    raise ConfigError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")


def target_info(name: str, base: Path) -> dict:
    """What the bench reports of a target: its description and, for the new version, its build's figures."""
    path = base / TARGET_FILE
    info = json.loads(path.read_text()) if path.is_file() else {}
    return {"description": DESCRIPTIONS[name], **info}


def print_perplexities(info: dict) -> None:
    """The new version's held-out perplexity per corpus, before and after its continued training."""
    ppl = info["perplexity"]
    print(f"{'held-out perplexity':<22}{'source':>10}{'target':>14}{'shift':>9}")
    for corpus, before in ppl["before"].items():
        after = ppl["after"][corpus]
        print(f"{corpus:<22}{before:>10.2f}{after:>14.2f}{(after / before - 1) * 100:>+8.1f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the Trans-LoRA bench's new-version target base once.")
    parser.add_argument("--work", help="the bench's work dir (default: $MANYFOLD_HOME/bench-translora)")
    args = parser.parse_args()
    from serve.data.cache import home

    base = new_version_base(Path(args.work) if args.work else home() / "bench-translora")
    print(base)
    print_perplexities(json.loads((base / TARGET_FILE).read_text()))
