"""mergekit-extract-lora as the reference for `bench forms`' low-rank forms: the same fine-tune cut to the same rank
by the tool platforms use by hand, loaded as PEFT loads it, measured as Manyfold's forms are.

mergekit is not a dependency: it pins its own transformers, so it lives in a virtual environment of its own and
the benchmark runs its command (`--mergekit PATH`). What its output needs, found by running mergekit 0.1.5 here:
- a base with the fine-tune's tensor names (a MiniLM classifier's are "bert."-prefixed, the sentence-transformers
  base's are not): the base loaded into the fine-tune's architecture, its fresh head drawn with seed 0 (mergekit
  factors the head's delta against it);
- its adapter_config.json says task_type CAUSAL_LM whatever the model, and keeps each factored layer's bias delta
  as lora_B.bias: PEFT loads it with task_type null and lora_bias true (without lora_bias it silently drops them).
It keeps embeddings and LayerNorms whole (in modules_to_save), which Manyfold's form drops.
"""

import json
import shutil
import subprocess
from pathlib import Path

import torch

from serve.errors import ArtifactError


def base_like(base_dir: Path, finetuned: Path, out: Path, causal: bool) -> Path:
    """The base as mergekit needs it: in the fine-tune's architecture and tensor names."""
    import transformers

    if causal:
        return base_dir
    if not (out / "config.json").is_file():
        config = transformers.AutoConfig.from_pretrained(finetuned)
        torch.manual_seed(0)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            base_dir, num_labels=config.num_labels, id2label=config.id2label, label2id=config.label2id)
        model.save_pretrained(out)
    return out


def extract(tool: str, finetuned: Path, base: Path, rank: int, out: Path) -> Path:
    """Run mergekit-extract-lora at a fixed rank (its --max-rank with the default sv-epsilon of 0)."""
    if not (out / "adapter_model.safetensors").is_file():
        cmd = [tool, "--model", str(finetuned), "--base-model", str(base), "--out-path", str(out),
               "--max-rank", str(rank), "--device", "cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ArtifactError(f"{' '.join(cmd)}: exit {done.returncode}: {last}")
    return out


def load(adapter: Path, base: Path, architecture: str, work: Path) -> tuple[torch.nn.Module, int]:
    """(the PEFT model mergekit's adapter makes of the base, the adapter's bytes)."""
    import transformers
    from peft import PeftModel

    patched = work / f"{adapter.name}-peft"
    shutil.copytree(adapter, patched, dirs_exist_ok=True)
    config = json.loads((patched / "adapter_config.json").read_text())
    config.update(task_type=None, lora_bias=True)
    (patched / "adapter_config.json").write_text(json.dumps(config, indent=2))
    model = getattr(transformers, architecture).from_pretrained(base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, patched).eval()
    return peft, (adapter / "adapter_model.safetensors").stat().st_size
