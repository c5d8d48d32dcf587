"""Plain values that cross from the engine to the deployments and the HTTP ingress: no torch here, so the
ingress process never imports it."""

from dataclasses import dataclass, field
from typing import Literal

Residency = Literal["hot", "warm", "cold"]
"""Where a model's weights are, named by what a request needs before it runs, so that they mean the same on a CPU
and a GPU server: hot, held in the cache's fast tier (the engine's device memory: GPU memory on CUDA, host memory
on CPU), nothing to do; warm, held in host memory, to be promoted first (a copy to the GPU; bookkeeping on CPU);
cold, only on disk, to be loaded (and decoded) first. A base is hot while its replica runs."""


@dataclass(frozen=True)
class Tenant:
    """Whom a request is for, as the engine orders rows of many tenants (serve/engine/scheduling/fairness.py)."""

    name: str
    weight: float = 1.0
    """Its share of the engine when tenants wait for it."""


ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match (structured outputs), as the grammar library compiles it
    (serve/engine/generation/grammars.py): plain text, so that it crosses from the ingress to a replica as it is."""

    kind: ConstraintKind
    spec: str = ""
    """json: a JSON schema, as JSON text; regex: a pattern; choice: a JSON list of the strings allowed; grammar: an
    EBNF grammar (xgrammar's dialect, as vLLM takes it); json_object: nothing (any JSON object)."""


@dataclass(frozen=True)
class SamplingParams:
    """A row's sampling controls, with OpenAI's and vLLM's meanings (serve/engine/generation/sampling.py applies
    them)."""

    max_tokens: int | None = 16
    """None: up to the end of the context, within the server's limit. 0: the prompt only (with echo)."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """The k most likely tokens only; 0: all."""
    min_p: float = 0.0
    """Tokens less likely than min_p times the most likely one are left out."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or the output so far divided by it where positive, multiplied where negative
    (transformers' and vLLM's rule); 1: none."""
    frequency_penalty: float = 0.0
    """OpenAI's: each logit less this times the token's count in the output so far."""
    presence_penalty: float = 0.0
    """OpenAI's: each logit less this where the token is in the output so far."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, added to its logit) pairs."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the row as its end-of-turn token does (counted, in neither its tokens nor its text)."""
    include_stop_str_in_output: bool = False
    """A stop string (or stop token's text) ending the text stays in it."""
    min_tokens: int = 0
    """The end-of-turn and stop tokens are not sampled before this many tokens."""
    ignore_eos: bool = False
    """The end-of-turn token does not end the row (it is kept as any token): it runs to max_tokens or a stop."""
    skip_special_tokens: bool = True
    """Special tokens are left out of the text."""
    constraint: Constraint | None = None
    """Structured outputs: the output matches it, every token sampled under its grammar's mask."""
    logprobs: int | None = None
    """Each generated token's log probability with this many top alternatives; None: none."""
    echo: bool = False
    """The prompt's own tokens come back too, with their log probabilities when logprobs is set."""

    @property
    def echoes_logprobs(self) -> bool:
        """The prompt's log probabilities come back: the logits of its every position are kept, none of its keys
        and values read from the prefix cache."""
        return self.echo and self.logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """One token as text, its log probability under the model (None for a prompt's first token, which nothing
    predicts) and the most likely tokens at its position, most likely first."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    prompt_text: str = ""
    """The prompt as the model read it (echo only)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, as far as it has gone (the end token included)."""
    end_token: int | None = None
    """The end-of-turn token that ended it, if one did: sampled, so counted, but in neither token_ids nor text."""
    cached_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache (OpenAI's prompt_tokens_details)."""

    @property
    def completion_tokens(self) -> int:
        """Every token sampled, the end-of-turn token included, as vLLM counts (len(output.token_ids)): the same
        count in usage, in logprobs and in manyfold_tokens_total."""
        return len(self.token_ids) + (self.end_token is not None)


@dataclass(frozen=True)
class TextDelta:
    """A piece of a streamed completion; the last one carries the whole Generation (finish reason, counts)."""

    text: str
    final: Generation | None = None
    completion_tokens: int = 0
    """Completion tokens so far (vLLM's continuous usage)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache."""
    logprobs: list[TokenLogprob] | None = None
    """The generated tokens this piece completes (when asked)."""
    prompt_text: str | None = None
    """First piece only, when echo or logprobs were asked: the prompt as the model read it."""
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int
    """Tokens read, after truncation."""
    truncated: int = 0
    """Inputs cut to the model's input limit."""


@dataclass(frozen=True)
class Classifications:
    labels: list[str]
    probs: list[list[float]]
    """One probability row per input, in the order of labels."""
    prompt_tokens: int
    truncated: int = 0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    base: str | None
    residency: Residency
    labels: list[str] | None
    status: Literal["ready", "unavailable"] = "ready"
    """"unavailable": its base has no running replica (its requests get 503 saying why)."""
    form: str | None = None
    """How a variant is held: its kind, or what `store add --kind auto` chose and measured."""
    alias_of: str | None = None
    """The entry's model that answers this name, when the name is an alias (`manyfold store upgrade`)."""
