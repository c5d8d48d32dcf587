"""What a Hugging Face model directory holds, as the store and the codecs read it: its config and architecture,
whether transformers builds it as a causal LM or a classifier (and its labels), and which of its files are the
tokenizer's (shared by a variant with its base) or never copied (pickled or GGUF weights).
"""

import json
from pathlib import Path

from serve.errors import ArtifactError

NOT_COPIED = (".*", "*.gguf", "*.bin", "*.pt", "*.pth")
"""Files of a model directory never copied into a store: hidden ones and pickled or GGUF weights."""


def read_model_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not model_dir.is_dir() or not path.is_file():
        raise ArtifactError(f"{model_dir}: not a HF model directory (no config.json)")
    from serve.store.tensors import weight_files

    weight_files(model_dir)
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from e


def architecture_of(config: dict, where: Path) -> str:
    archs = config.get("architectures") or [config.get("model_type")]
    if not archs or not isinstance(archs[0], str):
        raise ArtifactError(f"{where}/config.json names no architecture")
    return archs[0]


def is_causal_lm(architectures: list[str] | str | None) -> bool:
    """Whether AutoModelForCausalLM builds any of these architectures, by transformers' own mapping: GPT-2's
    GPT2LMHeadModel is causal though its name does not end in ForCausalLM. The class name decides, not the
    config's model type: the mapping also holds a causal head for encoders (bert: BertLMHeadModel)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = [architectures] if isinstance(architectures, str) else architectures or []
    return any(a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for a in names)


TOKENIZER_FILES = ("vocab.txt", "merges.txt", "special_tokens_map.json", "chat_template.jinja")


def is_tokenizer_file(name: str) -> bool:
    """What a variant shares with its base's tokenizer: TOKENIZER_FILES and every file named *token*."""
    return "token" in name or name in TOKENIZER_FILES


def classifier_labels(config: dict) -> list[str] | None:
    """A sequence classifier's class names as transformers reads its config: one without id2label gets
    LABEL_0 .. LABEL_{num_labels-1}, as transformers 5 saves a classifier with default labels."""
    from transformers import PretrainedConfig

    if not any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return None
    read = PretrainedConfig.from_dict(config)
    return [str(read.id2label[i]) for i in range(read.num_labels)]
