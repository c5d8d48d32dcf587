"""Variant kinds, one module each; importing this package registers every kind (serve.variants.base)."""

from serve.variants import emr, full, lora, pissa  # noqa: F401  (each registers its kind)
from serve.variants.base import VARIANT_KINDS, variant_kind  # noqa: F401
