"""Structured outputs: a row's constraint (a JSON schema, any JSON object, a regex, a choice of strings, an EBNF
grammar) compiled by xgrammar against its base's tokenizer, and the matcher that gives the row's token bitmask at
every step (serve/engine/generation/sampling.py applies it to the row's logits on the device).

Compiling is off the step and off the event loop: on a worker thread, once per (base, constraint), the result kept
in a cache bounded in bytes, the least recently used evicted first, and bounded per tenant, so that one tenant's
schemas cannot push out everyone else's. A request waits for its grammar before it becomes a row (the rows already
running go on); a compile that takes longer than the bound, or a constraint the library refuses, is the request's
400, and nothing ran. Why xgrammar (measured beside llguidance in serve/README.md): it fills a row's mask in
0.01-0.04 ms, paid every step, where its compile (milliseconds, or seconds for a schema with bounded strings) is
paid once per schema and releases the GIL; it is vLLM's and SGLang's default, takes vLLM's EBNF grammars as they
are, and its kernel applies a batch's masks on CUDA.
"""

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from serve.config import StructuredOutputsConfig
from serve.engine.types import Constraint
from serve.errors import BadRequest, Overloaded

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""Where in xgrammar's sources an error was raised (its messages start with it): not the client's business."""


def _xgrammar():
    """xgrammar, imported at its first use (a quarter of a second): a process never asked for a constraint does not
    load it."""
    import xgrammar

    return xgrammar


class Unwritable(Exception):
    """A grammar the model's vocabulary cannot begin to write (a word-level vocabulary and JSON, say)."""


def bitmask_for(rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the host, every token allowed."""
    return _xgrammar().allocate_token_bitmask(rows, vocab)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits [k, vocab]: the tokens a row's bitmask leaves out set to -inf, for the given rows (xgrammar's kernel: its
    Triton kernel on CUDA, its C++ loop on a CPU)."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


class RowGrammar:
    """One row's place in its grammar (the compute thread's): what it may take next, and whether it is complete."""

    def __init__(self, compiled: Any):
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Take a sampled token; False: the grammar refuses it (a token its mask left out)."""
        return self.matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        """The output is whole: the grammar took its end token, and nothing may follow."""
        return self.matcher.is_terminated()


def grammar_source(c: Constraint) -> tuple[str, str]:
    """A constraint as the compiler takes it: (the compiler's method, its text), a JSON schema without its spaces,
    so that two requests that differ only in how they spaced it share one compile (its keys keep their order: the
    properties' order is the output's)."""
    if c.kind == "json":
        return "json", json.dumps(json.loads(c.spec), separators=(",", ":"))
    if c.kind == "json_object":
        return "json", '{"type":"object"}'
    if c.kind == "choice":
        choices = json.loads(c.spec)
        return "ebnf", "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", s) + '"' for s in choices)
    return ("regex" if c.kind == "regex" else "ebnf"), c.spec


@dataclass
class _Kept:
    compiled: Any
    nbytes: int
    tenant: str


@dataclass
class GrammarStats:
    compiles: int = 0
    """Grammars compiled (cache misses that compiled)."""
    hits: int = 0
    """Requests whose grammar was in the cache or already compiling."""
    evictions: int = 0
    refused: int = 0
    """Constraints the library refused, or whose compile ran past the bound."""


class Grammars:
    """One base's compiled grammars. Everything but the compile itself runs on the event loop."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab: int, end_ids: set[int],
                 config: StructuredOutputsConfig, pool: Executor):
        """load_tokenizer: the base's tokenizer, loaded on the worker (a tokenizer is never shared between threads:
        serve/engine/prompts.py)."""
        self.load_tokenizer, self.vocab, self.end_ids = load_tokenizer, vocab, sorted(end_ids)
        self.config = config
        self.pool = pool
        self.stats = GrammarStats()
        self._compiler: Any = None
        """xgrammar's compiler over the tokenizer, made on the worker at the first compile (about 0.3 s)."""
        self._kept: OrderedDict[tuple[str, str], _Kept] = OrderedDict()
        self._compiling: dict[tuple[str, str], asyncio.Future] = {}

    def counters(self) -> dict[str, int]:
        """For metrics: the events of GrammarStats, and the bytes kept."""
        st = self.stats
        return {"compiles": st.compiles, "hits": st.hits, "evictions": st.evictions, "refused": st.refused,
                "bytes": sum(k.nbytes for k in self._kept.values())}

    async def compile(self, c: Constraint, tenant: str) -> Any:
        """The constraint's compiled grammar (from the cache, or compiled on the worker; a request for a grammar
        already compiling waits for that one); BadRequest naming why for a constraint the library refuses or a
        compile past the bound, Overloaded when too many are compiling."""
        try:
            key = grammar_source(c)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"structured output ({c.kind}): not valid JSON ({e})") from None
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self.stats.hits += 1
            return kept.compiled
        running = self._compiling.get(key)
        if running is None:
            if len(self._compiling) >= self.config.max_compiling:
                raise Overloaded(f"{len(self._compiling)} grammars are compiling already; retry later")
            running = asyncio.get_running_loop().run_in_executor(self.pool, self._compile, key)
            self._compiling[key] = running
            running.add_done_callback(lambda f: self._compiled(key, f, tenant))
        else:
            self.stats.hits += 1
        try:
            return await asyncio.wait_for(asyncio.shield(running), self.config.compile_timeout_s)
        except TimeoutError:
            self.stats.refused += 1
            raise BadRequest(f"structured output ({c.kind}): compiling its grammar took longer than "
                             f"{self.config.compile_timeout_s:g} s") from None
        except Unwritable as e:
            self.stats.refused += 1
            raise BadRequest(f"structured output ({c.kind}): {e}") from None
        except (RuntimeError, ValueError) as e:  # xgrammar's refusals (InvalidJSONError is a ValueError)
            self.stats.refused += 1
            reason = _LOCATION.sub("", (str(e).strip().splitlines() or [type(e).__name__])[-1])[:300]
            raise BadRequest(f"structured output ({c.kind}): the grammar library refuses it: {reason}") from None

    def _compile(self, key: tuple[str, str]) -> Any:
        """On the worker thread."""
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.load_tokenizer(), vocab_size=self.vocab,
                                                      stop_token_ids=self.end_ids or None)  # None: the tokenizer's
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        method, text = key
        if method == "json":  # one layout, no free whitespace: a small model cannot run on in spaces
            out = self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        elif method == "regex":
            out = self._compiler.compile_regex(text)
        else:
            out = self._compiler.compile_grammar(text)
        first = bitmask_for(1, self.vocab)
        xgr.GrammarMatcher(out).fill_next_token_bitmask(first, 0)
        if not first.any():
            raise Unwritable("no token of this model's vocabulary can start it")
        return out

    def _compiled(self, key: tuple[str, str], done: asyncio.Future, tenant: str) -> None:
        """On the event loop: a compile that succeeded is kept, within the tenant's share and the cache's bytes."""
        self._compiling.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        self.stats.compiles += 1
        compiled = done.result()
        kept = _Kept(compiled, int(compiled.memory_size_bytes), tenant)
        most = self.config.cache_mib * (1 << 20)
        share = most * self.config.tenant_share
        if kept.nbytes > share:
            return
        self._evict(lambda k: k.tenant == tenant, share - kept.nbytes)
        self._evict(lambda k: True, most - kept.nbytes)
        self._kept[key] = kept

    def _evict(self, whose, room: float) -> None:
        """The least recently used grammars that `whose` picks, until those left of them take at most `room` bytes."""
        held = sum(k.nbytes for k in self._kept.values() if whose(k))
        for key in [key for key, k in self._kept.items() if whose(k)]:
            if held <= room:
                return
            held -= self._kept.pop(key).nbytes
            self.stats.evictions += 1
