"""A base held in NeuZip form: its Linear weights stay coded in memory and are decoded right before use.

The model is built without weights (accelerate's init_empty_weights); raw tensors (embeddings, norms, biases:
serve/codecs/neuzip_file.py says which) are loaded as they are, and every coded weight stays a meta
placeholder of the right shape and dtype, so the variant seam (serve/engine/families/layers.py, slots.py) sees the
module it always sees. The module's wrapper (layers.py: SlotModule) calls, around the module and its corrections:
- `install`: have the weight decoded (on the CPU by serve/engine/neuzip/decoder.py, inline or ahead into a
  buffer of its own; on a GPU by serve/engine/neuzip/groups.py, its group of weights in one launch) and put it in
  place of the placeholder;
- `restore` (after the corrections have run, also when the forward raised): put the placeholder back.
Resident weights are then the coded streams, the raw tensors and the decoders' buffers (on the CPU four decoded
weights, on a GPU one group's). A decoded-layer budget keeps some weights decoded for good, in model order until
the budget is spent: every weight runs once per forward, so which ones are kept only changes how much decoding
is saved, byte for byte.
"""

from pathlib import Path

import torch

from serve.codecs.neuzip_file import NzpFile, Stream, decode
from serve.engine.neuzip.decoder import AHEAD_MAX_TOKENS, WeightDecoder
from serve.engine.neuzip.groups import GroupDecoder
from serve.errors import ArtifactError


def empty_model(cls, model_dir: str | Path) -> torch.nn.Module:
    """model_dir's architecture in bf16 with every parameter a meta placeholder (buffers are real), its
    parameters in the model's own order."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights(include_buffers=False):
        return cls.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)


def load_model(cls, model_dir: str | Path, nzp: NzpFile, device: torch.device) -> tuple[torch.nn.Module,
                                                                                          dict[str, Stream]]:
    """(the model with coded weights as meta placeholders and everything else loaded on `device`, the coded
    weights' streams on `device` by parameter name). Every stream is decoded and checked once here."""
    from transformers import GenerationConfig
    from transformers.pytorch_utils import Conv1D

    matmuls = (torch.nn.Linear, Conv1D)  # a forward reads their whole weight: only these decode it on use

    model = empty_model(cls, model_dir)
    if (Path(model_dir) / "generation_config.json").exists():  # as from_pretrained reads it (eos tokens)
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    streams, raw = {}, {}
    for name in params:  # the model's order (the file's is by name): a GPU decodes weights in groups of neighbours
        r = nzp.records.get(name)
        if r is None:
            continue  # tied, or a tensor the file does not hold (the check below names those missing)
        if tuple(r.shape) != tuple(params[name].shape):
            raise ArtifactError(f"{nzp.path}: tensor '{name}' has shape {list(r.shape)}, the model's config says "
                                f"{list(params[name].shape)}")
        if r.codec == "neuzip" and isinstance(modules[name.rsplit(".", 1)[0]], matmuls):
            streams[name] = nzp.stream(name).to(device)
        else:  # raw, or coded but read in part (an embedding table whose name did not say so): held decoded
            raw[name] = nzp.tensor(name).to(device)
    model.load_state_dict(raw, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # a tied LM head shares the embedding just loaded
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta and n not in streams]
    if missing:
        raise ArtifactError(f"{nzp.path}: no weights for {', '.join(missing[:3])}")
    for module in model.modules():
        for k, b in module._buffers.items():
            if b is not None:
                module._buffers[k] = b.to(device)
    return model.eval(), streams


class CodedWeights:
    """The coded weights of one model, installed and restored by their modules' wrappers (see the module's
    docstring)."""

    def __init__(self, model: torch.nn.Module, streams: dict[str, Stream], decoded_bytes: int = 0,
                 ahead_max_tokens: int = AHEAD_MAX_TOKENS):
        """ahead_max_tokens: forwards of at most this many tokens decode ahead (serve/engine/neuzip/decoder.py)."""
        self.streams: dict[str, Stream] = {}
        """The weights decoded on use: their streams are all that stays resident of them."""
        self.kept: dict[str, torch.Tensor] = {}
        """The weights decoded for good, within the budget: plain parameters now (their streams are dropped)."""
        self.placeholders: dict[str, torch.nn.Parameter] = {}
        """Module name -> its weight's meta placeholder, for the modules whose weight is decoded on use."""
        self.version = 0
        """Changes whenever weights are kept decoded (their modules' parameters, and the decoder, are new)."""
        self._modules = dict(model.named_modules())
        self._device = next(iter(streams.values())).words.device if streams else torch.device("cpu")
        self._ahead_max_tokens = ahead_max_tokens
        for name, s in streams.items():
            mname, local = name.rsplit(".", 1)
            if local != "weight":
                raise ValueError(f"coded tensor '{name}' is no module's weight")
            self.streams[name] = s
            self.placeholders[mname] = self._modules[mname].weight
        self.decoder = self._new_decoder()
        self.keep(decoded_bytes)

    def is_coded(self, module: str) -> bool:
        """Whether the module's weight is decoded on use."""
        return module in self.placeholders

    def install(self, module: str, m: torch.nn.Module) -> None:
        """The module's weight decoded, in place of its placeholder."""
        m._parameters["weight"] = self.decoder.weight(module)

    def restore(self, module: str, m: torch.nn.Module) -> None:
        m._parameters["weight"] = self.placeholders[module]

    def _new_decoder(self) -> WeightDecoder | GroupDecoder:
        """On the CPU decoding ahead or inline, measured (WeightDecoder); elsewhere a group of weights a launch."""
        streams = {n.rsplit(".", 1)[0]: s for n, s in self.streams.items()}
        if self._device.type != "cpu":
            return GroupDecoder(streams, self._device)
        return WeightDecoder(streams, self._device, self._ahead_max_tokens)

    def keep(self, budget: int) -> int:
        """Decode weights for good, in model order, while their bf16 bytes fit `budget` (a weight that does not
        fit is skipped, a smaller later one may): each becomes a plain parameter and its stream is dropped.
        Returns the bytes kept. Call between forwards (the engine's compute thread)."""
        kept = 0
        for name in list(self.streams):
            nbytes = 2 * self.streams[name].numel
            if nbytes > budget - kept:
                continue
            kept += nbytes
            s = self.streams.pop(name)
            mname = name.rsplit(".", 1)[0]
            del self.placeholders[mname]
            self.kept[name] = decode(s)
            self._modules[mname]._parameters["weight"] = torch.nn.Parameter(self.kept[name], requires_grad=False)
        if kept:
            self.decoder.close()
            self.decoder = self._new_decoder()
            self.version += 1
        return kept

    @property
    def coded_bytes(self) -> int:
        """The streams of the weights decoded on use."""
        return sum(s.nbytes for s in self.streams.values())

    @property
    def decoded_size(self) -> int:
        """bf16 bytes of every coded weight, decoded on use or kept."""
        return 2 * (sum(s.numel for s in self.streams.values()) + sum(t.numel() for t in self.kept.values()))

    @property
    def nbytes(self) -> int:
        """What the coded weights hold beyond the model's parameters: the streams of the weights decoded on use
        and the buffers they decode into (weights kept decoded are parameters)."""
        return self.coded_bytes + self.decoder.nbytes

    def close(self) -> None:
        self.decoder.close()
