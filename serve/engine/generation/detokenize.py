"""What a generating row gives its caller beside token ids: its text, decoded a few tokens at a time, where it
stops (end of text, a stop string, max_tokens), and the log probabilities it asked for, each token's as text.

A token's text depends on its neighbours (a SentencePiece word's leading space, a character split over byte
tokens), so text is decoded after CONTEXT tokens of what came before (the prompt's tail first), and the tokens
since the last piece are decoded again until they end on a whole character (vLLM's incremental detokenizer).
The batch (decode_batch.py) decides when a row has a token; this module only turns tokens into what a row returns.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from serve.engine import faults
from serve.engine.types import Generation, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from serve.engine.model import BaseModelRuntime

CONTEXT = 5
"""Tokens of context a piece of text is decoded after."""


@dataclass(eq=False)
class RowText:
    """One row's output so far: its Generation, and where its text is decoded up to."""

    gen: Generation
    params: SamplingParams
    name: str
    """The cache entry it runs, or the base's name (what a fault names)."""
    tail: list[int]
    """The prompt's last CONTEXT tokens: the text is decoded after them, so it reads as a continuation."""
    prefix_offset: int = 0
    """Incremental decoding over tail + token_ids: text is known up to read_offset; tokens from prefix_offset
    are re-decoded for context, so a piece that only makes sense after its neighbours comes out right."""
    read_offset: int = 0

    @classmethod
    def after(cls, prompt_tokens: list[int], params: SamplingParams, name: str, **more) -> "RowText":
        """A row that has taken no token yet (more: a subclass's fields)."""
        gen = Generation(prompt_tokens=len(prompt_tokens), logprobs=[] if params.logprobs is not None else None)
        tail = prompt_tokens[-CONTEXT:]
        return cls(gen, params, name, tail, read_offset=len(tail), **more)

    def context(self) -> list[int]:
        """The CONTEXT tokens before the next one."""
        return (self.tail + self.gen.token_ids)[-CONTEXT:]


class Detokenizer:
    """A base's tokenizer and end-of-text ids, applied to rows' tokens. Both are read from the runtime at every
    use, so a caller that sets rt.eos_ids (a benchmark that runs rows to max_tokens) is heard whenever it does."""

    def __init__(self, rt: "BaseModelRuntime"):
        self.rt = rt

    def advance(self, r: RowText, tok: int) -> bool:
        """Append one token; -> whether the row is finished (its finish_reason set)."""
        gen, params = r.gen, r.params
        if params.max_tokens == 0:  # the prompt alone was asked for (echo)
            return True
        if (tok in self.rt.eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            gen.finish_reason, gen.end_token = "stop", tok
            self.flush(r)
            return True
        gen.token_ids.append(tok)
        before = len(gen.text)
        faults.hit("detokenize", [r.name])
        self._decode_new(r)
        longest_stop = max((len(x) for x in params.stop), default=0)
        for x in params.stop:
            at = gen.text.find(x, max(0, before - longest_stop + 1))
            if at >= 0:
                gen.text = gen.text[:at + len(x) if params.include_stop_str_in_output else at]
                gen.finish_reason = "stop"
                return True
        if len(gen.token_ids) >= params.max_tokens:
            gen.finish_reason = "length"
            self.flush(r)
            return True
        return False

    def flush(self, r: RowText) -> None:
        """The text of every token taken, half a character included: the row ends."""
        if r.read_offset < len(r.tail) + len(r.gen.token_ids):
            self._decode_new(r, final=True)

    def logprobs(self, logits: torch.Tensor, tokens: list[int], k: int, contexts: list[list[int]]
                 ) -> list[TokenLogprob]:
        """[n, vocab] fp32 logits and the token taken at each (after its context) -> its log probability and
        the top k there, each as its text after that context."""
        lp = torch.log_softmax(logits, -1)
        taken = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
        top_lp, top_ids = (x.tolist() for x in lp.topk(k, -1)) if k else ([[]] * len(tokens), [[]] * len(tokens))
        out = []
        for t, v, ids, ps, ctx in zip(tokens, taken, top_ids, top_lp, contexts):
            before = self.rt.tokenizer.decode(ctx)
            piece = [self.rt.tokenizer.decode(ctx + [i])[len(before):] for i in (t, *ids)]
            out.append(TokenLogprob(piece[0], v, list(zip(piece[1:], ps))))
        return out

    def prompt_logprobs(self, prompt: list[int], logits: torch.Tensor, k: int) -> list[TokenLogprob]:
        """logits [len(prompt), vocab] of the prompt's positions: position j predicts token j + 1."""
        first = TokenLogprob(self.rt.tokenizer.decode(prompt[:1]), None, [])
        contexts = [prompt[max(0, j + 1 - CONTEXT):j + 1] for j in range(len(prompt) - 1)]
        return [first] + self.logprobs(logits[:-1], prompt[1:], k, contexts)

    def _decode_new(self, r: RowText, final: bool = False) -> None:
        decode = self.rt.tokenizer.decode
        ids = r.tail + r.gen.token_ids
        skip = r.params.skip_special_tokens
        known = decode(ids[r.prefix_offset:r.read_offset], skip_special_tokens=skip)
        text = decode(ids[r.prefix_offset:], skip_special_tokens=skip)
        if len(text) > len(known) and (final or not text.endswith("\ufffd")):  # half a character waits
            r.gen.text += text[len(known):]
            r.prefix_offset, r.read_offset = r.read_offset, len(ids)
