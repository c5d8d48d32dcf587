"""Plain values that cross from the engine to the deployments and the HTTP ingress: no torch here, so the
ingress process never imports it."""

from dataclasses import dataclass, field
from typing import Literal

Residency = Literal["device", "cpu", "disk"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0


@dataclass(frozen=True)
class TextDelta:
    """A piece of a streamed completion; the last one carries the whole Generation (finish reason, counts)."""

    text: str
    final: Generation | None = None


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    base: str | None
    residency: Residency
    labels: list[str] | None
