"""Trained PiSSA adapters (kind "pissa"), served in their converted form: a rank-2r LoRA on the original base.

PiSSA trains (A1, B1) on the residual W_res = W - s B0 A0. Against the original W the trained weight is
W_res + s B1 A1 = W + s (B1 A1 - B0 A0) = W + s [B1 | -B0] [A1 ; A0]: a plain LoRA of rank 2r, which is what
PEFT's `save_pretrained(path_initial_model_for_weight_conversion=...)` and `manyfold adapter convert` write.
Served like any LoRA; a raw adapter, still relative to its residual base, is refused with how to convert it.
"""

from serve.store.manifest import PissaVariantEntry
from serve.variants.base import register_variant
from serve.variants.lora import LoraVariant


class PissaVariant(LoraVariant):
    kind = "pissa"
    help = "a trained PiSSA adapter in converted form (rank 2r LoRA on the original base; see `adapter convert`)"
    entry_type = PissaVariantEntry


register_variant(PissaVariant())
