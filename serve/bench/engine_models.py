"""The models and adapters `manyfold bench engine` builds: Llama shapes from their configs with random weights (no
hub is reachable from a lent GPU machine), PEFT adapter directories and loaded adapters with trained-looking random
weights, full fine-tunes of the top two layers, EMR groups, PEFT's model over them, and the memory floor of a step
that reads them. Throughput does not depend on what the weights learned, only on their shapes."""

from pathlib import Path

import torch

TARGETS = ("q_proj", "v_proj")
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {  # Llama-shaped configs of the models the issue names (random weights), and one for tests
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, rope_theta=10000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def build_model_dir(shape: str, out: Path, device: torch.device, max_positions: int = 4096) -> Path:
    """A Llama of the named shape with random weights in bf16, and a word-level tokenizer over its whole
    vocabulary (no hub is reachable): ids in, ids out."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / "config.json").exists():
        return out
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, initializer_range=0.02, dtype="bfloat16")
    torch.manual_seed(0)  # the same model every build
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0",
                            unk_token="w3").save_pretrained(out)
    del model
    return out


def module_dims(model_dir: Path, targets: tuple[str, ...] = TARGETS) -> dict[str, tuple[int, int]]:
    """(in, out) of every targeted Linear of a Llama-shaped model, by module name."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, m = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size, \
        c.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, m),
            "up_proj": (h, m), "down_proj": (m, h)}
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return {f"model.layers.{i}.{parent.get(t, 'mlp')}.{t}": dims[t] for i in range(c.num_hidden_layers)
            for t in targets}


def write_adapter(out: Path, dims: dict[str, tuple[int, int]], rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter directory on the modules of `dims` with trained-looking random A and B (A ~ 1/sqrt(in),
    B small)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_f, out_f) in dims.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g)
                                                                / in_f ** 0.5).to(torch.bfloat16)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g)
                                                                * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({m.rsplit(".", 1)[1] for m in dims})
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM").save_pretrained(out)
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def loaded_adapter(name: str, dims: dict[str, tuple[int, int]], rank: int, seed: int, dtype: torch.dtype,
                   device: torch.device):
    """The same adapter as write_adapter, straight into a LoadedVariant (for step timings, no store)."""
    from serve.variants.base import LoadedVariant

    g = torch.Generator().manual_seed(seed)
    tensors, scales = {}, {}
    for module, (in_f, out_f) in dims.items():
        tensors[f"{module}.A"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).to(dtype).to(device)
        tensors[f"{module}.B"] = (torch.randn(out_f, rank, generator=g) * 0.02).to(dtype).to(device)
        scales[module] = 2.0
    return LoadedVariant(name, "lora", "lora", tensors, scales)


def top2_finetune(rt, name: str, seed: int):
    """A full fine-tune of the top two layers, as the cache would hold it (weights family)."""
    from serve.variants.base import LoadedVariant

    g = torch.Generator(device=rt.device).manual_seed(seed)
    top = top_layers(rt)
    tensors = {k: t + torch.randn(t.shape, generator=g, device=rt.device, dtype=t.dtype) * 1e-3
               for k, t in rt.view.tensors.items() if any(p in k for p in top)}
    return LoadedVariant(name, "full", "weights", tensors)


def emr_tasks(rt, name: str, tasks: int, seed: int, only: tuple[str, ...], scale: float = 1e-3) -> list:
    """An EMR group over every floating tensor of a runtime's base whose name holds one of `only`, as the variant
    cache would hold it: tau_uni random (`scale` of each tensor's spread), each task's mask a random half -> its
    tasks' variants (what a row of `name/t<k>` runs). A tensor's spread is its mean magnitude (a norm's weights
    are all near one)."""
    from kernels import pack_bits
    from serve.variants.base import MASKS_SUFFIX, LoadedVariant

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for n, t in rt.view.tensors.items():
        if any(p in n for p in only) and t.is_floating_point() and not t.is_meta:
            spread = float(t.float().abs().mean())
            tensors[n] = (torch.randn(t.shape, generator=g) * scale * spread).to(t.dtype).to(t.device)
            tensors[n + MASKS_SUFFIX] = pack_bits(torch.rand(tasks, *t.shape, generator=g) > 0.5).to(t.device)
    group = LoadedVariant(name, "emr", f"emr:{name}", tensors, key=name)
    for k in range(tasks):
        group.members[f"{name}/t{k}"] = LoadedVariant(f"{name}/t{k}", "emr", group.family, {},
                                                      {"rescaler": 0.5 + 0.25 * k}, parent=group, index=k)
    return list(group.members.values())


def top_layers(rt, n: int = 2) -> tuple[str, ...]:
    """The name parts of a Llama's top n layers ("layers.14.", "layers.15.")."""
    layers = rt.model.config.num_hidden_layers
    return tuple(f"layers.{layers - k}." for k in range(n, 0, -1))


def floor_ms(rt, rows: int, context: int, bandwidth: float | None, variants: list | None = None) -> float | None:
    """The step's bytes over the bandwidth: the base's weights, each distinct variant's own tensors (an EMR group's
    tau_uni and masks once), every row's keys and values."""
    if bandwidth is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in rt.model.parameters() if not p.is_meta)
    kv = rows * (context + 1) * rt.kv.position_bytes
    return 1e3 * (weights + kv + variant_bytes(variants or [])) / bandwidth


def variant_bytes(variants: list) -> int:
    """Bytes of the distinct variants' tensors (a group's once, whichever of its tasks the rows run)."""
    seen = {id(v.parent or v): v.parent or v for v in variants if v is not None}
    return sum(t.numel() * t.element_size() for v in seen.values() for t in v.tensors.values())


def peft_with(plain, adapters: dict[str, Path]):
    """PEFT's model over a plain transformers copy of the base, every adapter loaded by name."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(plain, adapters[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(adapters[n], adapter_name=n)
    return model.eval()
