"""Model directories for serving tests: a tiny random Llama with a word-level tokenizer (built in code, no
download), and classifier / causal "fine-tunes" made by perturbing a base (real fine-tuning is tested in
test_demo.py)."""

from pathlib import Path

import torch

from serve.store.model_dir import is_causal_lm, is_tokenizer_file

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "system:", "user:", "assistant:"] + (
    "the a cat dog sat on mat and ran to house tree big small red blue green one two three four five six "
    "seven eight nine ten is was what where who why how yes no hello world good bad day night sun moon "
    "star sky sea fish bird eat drink sleep play run walk talk read write book pen").split()


def write_tiny_causal(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2, positions: int = 256) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant:"
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=positions,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                      initializer_range=1.0)  # wide init: clear argmax margins and varied text, not one token
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_tiny_chat_lm(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (49,152 tokens, byte-level BPE): what
    structured outputs and tool calls need to write JSON, at a tiny model's cost."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from serve.data.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                      tie_word_embeddings=True, initializer_range=0.5)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_perturbed(src: Path, dst: Path, seed: int, scale: float = 0.02, only: str | None = None,
                    labels: list[str] | None = None) -> Path:
    """A 'fine-tune' of the model in src: every float tensor (or those containing `only`) nudged; with
    labels, saved as BertForSequenceClassification with a fresh head."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(src)
    if labels:
        model = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)})
    elif is_causal_lm(config.architectures):
        model = AutoModelForCausalLM.from_pretrained(src)
    else:
        model = AutoModel.from_pretrained(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and (only is None or only in name):
                p.add_(torch.randn_like(p) * scale * (p.abs().mean() + 1e-3))
    model.save_pretrained(dst)
    for f in src.iterdir():
        if is_tokenizer_file(f.name):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def write_lora(src: Path, dst: Path, seed: int, r: int, targets: list[str], classes: list[str] | None = None,
               **options) -> Path:
    """A PEFT LoRA adapter of the model in src with random, non-zero A and B (as if trained); with classes, a
    sequence-classification adapter whose head is saved through modules_to_save."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    if classes:
        model = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=len(classes), id2label=dict(enumerate(classes)))
        options.setdefault("task_type", "SEQ_CLS")
    elif is_causal_lm(AutoConfig.from_pretrained(src).architectures):
        model = AutoModelForCausalLM.from_pretrained(src)
    else:
        model = AutoModel.from_pretrained(src)
    peft = get_peft_model(model, LoraConfig(r=r, target_modules=targets, init_lora_weights=False, **options))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    peft.save_pretrained(dst)
    if classes:
        model.config.save_pretrained(dst)  # id2label for the store
    return dst


def write_tiny_bert(path: Path, seed: int = 0) -> Path:
    """A tiny random BERT encoder with a word-piece tokenizer over WORDS (built in code, no download)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS[7:]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, initializer_range=0.2)
    BertModel(cfg).save_pretrained(path)
    return path


def write_tiny_gpt2(path: Path, seed: int = 0, pad: bool = True) -> Path:
    """A tiny random GPT-2 whose tokenizer numbers the words in another order than write_tiny_causal's: another
    architecture and another tokenizer, for moving adapters between bases. pad=False: no pad token, as the real
    GPT-2 has none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = WORDS[:4] + WORDS[:3:-1]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            **({"pad_token": "<pad>"} if pad else {})).save_pretrained(path)
    cfg = GPT2Config(vocab_size=len(words), n_embd=48, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0 if pad else None, initializer_range=0.5)
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def random_lora(rt, name: str, rank: int, seed: int, targets: tuple[str, ...], scale: float | None = None):
    """A LoRA on every layer's `targets` of a runtime's base, A and B random (wide: a wrong row is far off), as the
    variant cache would hold it; scale alpha / r with alpha 16 unless given."""
    from serve.variants.base import LoadedVariant

    g = torch.Generator().manual_seed(seed)
    tensors, scales = {}, {}
    for module, linear in rt.view.modules.items():
        if module.endswith(targets):
            out_f, in_f = linear.weight.shape
            tensors[f"{module}.A"] = torch.randn(rank, in_f, generator=g) * 0.3
            tensors[f"{module}.B"] = torch.randn(out_f, rank, generator=g) * 0.3
            scales[module] = 16 / rank if scale is None else scale
    return LoadedVariant(name, "lora", "lora", tensors, scales)


def random_emr_group(rt, name: str, tasks: int, seed: int, only: str = "layers.1.") -> list:
    """An EMR group over the tensors of a runtime's base whose name holds `only`, tau_uni wide (a wrong task is far
    off): its tasks' variants."""
    from serve.bench.engine_models import emr_tasks

    return emr_tasks(rt, name, tasks, seed, (only,), scale=0.3)
