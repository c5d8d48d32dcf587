"""The tiny world the placeholders of the docs' commands stand for in tests/test_docs_run.py: a base, two full
fine-tunes of it, a LoRA, a PiSSA adapter raw and converted, an EMR bundle, an FM-Delta file, a NeuZip directory,
training and calibration data, and a store of each kind (a directory, file://, s3://) already holding a base, a full
fine-tune and a LoRA to remove."""

import itertools
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serve.cli import main

STORE_KINDS = ("path", "file", "s3")
"""A store in a local directory, one at a file:// URL and one at an s3:// URL."""
BASE, FULL, DOOMED = "tiny", "ft", "doomed"
"""What every store holds before the commands run: a base, a full fine-tune of it, and a LoRA for `store remove`."""


@dataclass
class World:
    """Tiny artefacts of one base (tests/models.py), and a store of each kind holding BASE, FULL and DOOMED."""

    root: Path
    base: Path
    finetune: Path
    finetune2: Path
    lora: Path
    pissa: Path
    pissa_trained: Path
    pissa_initial: Path
    loras: Path
    pissas: Path
    bundle: Path
    fmd: Path
    neuzip: Path
    data: Path
    calibration: Path
    stores: dict[str, str] = field(default_factory=dict)
    count: Callable[[], int] = field(default_factory=lambda: itertools.count().__next__)

    def fresh(self, what: str, suffix: str = "") -> Path:
        """A path nothing has written yet."""
        return self.root / "out" / f"{what}-{self.count()}{suffix}"


def build_world(root: Path, s3_endpoint: str) -> World:
    """The artefacts under root, and the three stores (the S3 one in a new bucket at s3_endpoint)."""
    import boto3

    from serve.adapters.convert import convert_pissa
    from serve.codecs import emr, fmdelta_file, neuzip_file
    from serve.store.tensors import SafetensorsSource
    from tests.models import WORDS, write_lora, write_perturbed, write_tiny_causal

    base = write_tiny_causal(root / "base")
    finetune = write_perturbed(base, root / "finetune", seed=1, scale=0.5, only="layers.1.")
    finetune2 = write_perturbed(base, root / "finetune2", seed=2, scale=0.5, only="layers.1.")
    lora = write_lora(base, root / "lora", seed=1, r=4, targets=["q_proj", "v_proj"])
    trained, initial = _raw_pissa(base, root)
    pissa = convert_pissa(trained, initial, root / "pissa")
    loras, pissas = root / "loras", root / "pissas"
    for i in range(2):
        shutil.copytree(lora, loras / f"lora{i}")
        shutil.copytree(pissa, pissas / f"pissa{i}")
    fine = SafetensorsSource(finetune)
    fmdelta_file.compress(SafetensorsSource(base), fine, root / "finetune.fmd", metadata=fine.metadata)
    neuzip_file.compress_dir(base, 7, root / "neuzip")
    data, calibration = root / "train.jsonl", root / "calibration.jsonl"
    words = WORDS[7:]
    data.write_text("".join(json.dumps({"prompt": " ".join(words[i:i + 4]), "completion": " yes" if i % 2 else " no"})
                            + "\n" for i in range(24)))
    calibration.write_text("".join(json.dumps({"text": " ".join(words[i:i + 8])}) + "\n" for i in range(8)))
    w = World(root, base, finetune, finetune2, lora, pissa, trained, initial, loras, pissas,
              emr.merge(base, {"a": finetune, "b": finetune2}, root / "bundle").path, root / "finetune.fmd",
              root / "neuzip", data, calibration)
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="docs-run")
    w.stores = {"path": str(root / "store"), "file": (root / "store-file").as_uri(), "s3": "s3://docs-run/store"}
    for location in w.stores.values():  # through the CLI: the first add makes the store, at a URL too
        for argv in (["--kind", "base", "--name", BASE, "--model", str(base)],
                     ["--kind", "full", "--name", FULL, "--base", BASE, "--model", str(finetune)],
                     ["--kind", "lora", "--name", DOOMED, "--base", BASE, "--model", str(lora)]):
            assert main(["store", "add", "--store", location, *argv]) == 0, f"store add --store {location} {argv}"
    return w


def _raw_pissa(base: Path, root: Path) -> tuple[Path, Path]:
    """A raw PiSSA adapter "trained" (its A and B nudged) and the initial one saved before: what `adapter convert`
    takes."""
    from serve.adapters.train import make_peft_model

    model, _ = make_peft_model(base, "pissa", 4, target_modules=["q_proj", "v_proj"], seed=0)
    model.save_pretrained(root / "pissa-initial")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    model.save_pretrained(root / "pissa-trained")
    return root / "pissa-trained", root / "pissa-initial"
