"""OpenAI's generation routes: POST /v1/completions and /v1/chat/completions, whole or streamed, with logprobs (and
echo for completions), n choices a prompt, structured outputs and tool calls, in the shapes OpenAI's clients parse.

A request of P prompts and n choices is P x n rows, choice i x n + j of prompt i drawing from seed + j."""

import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Depends, Request

from serve.config import LimitsConfig
from serve.engine.types import SamplingParams, TextDelta, TokenLogprob
from serve.errors import TooLarge
from serve.http import generation_schemas as G
from serve.http import schemas as S
from serve.http import tools as T
from serve.http.auth import allow, share, tenant
from serve.http.disconnect import while_connected
from serve.http.limits import check_max_tokens, check_texts
from serve.http.state import State
from serve.http.streaming import Choice, gather_all, stream
from serve.http.usage import count_tokens, usage
from serve.store.manifest import TenantEntry

router = APIRouter()


@router.post("/v1/completions", response_model=S.CompletionResponse)
async def completions(body: G.CompletionRequest, request: Request, state: State,
                      t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    prompts = body.prompts()
    if len(prompts) > state.limits.max_inputs:
        raise TooLarge(f"prompt: at most {state.limits.max_inputs} prompts per request, got {len(prompts)}")
    check_texts(state.limits, [p for p in prompts if isinstance(p, str)])
    choices = per_choice(_sampling(state.limits, body, body.max_tokens, logprobs=body.logprobs, echo=body.echo),
                         body.n)
    rows = [(p, params) for p in prompts for params in choices]
    want = body.logprobs is not None
    ticket = state.tenant_gate.admit(t)
    if body.stream:
        streams = [state.backend.complete_stream(body.model, params, prompt=p, tenant=share(t)) for p, params in rows]
        return await stream(request, state.metrics, body, streams, S.CompletionChunk, "cmpl",
                            _completion_chunks(body, len(rows)), ticket)
    with ticket:
        gens = await while_connected(request, gather_all(
            state.backend.complete(body.model, params, prompt=p, tenant=share(t)) for p, params in rows))
        ticket.tokens = usage(gens, body.n).total_tokens
    out = []
    for i, gen in enumerate(gens):
        count_tokens(state.metrics, body.model, gen, first=i % body.n == 0)
        entries = ((gen.prompt_logprobs or []) if body.echo else []) + (gen.logprobs or [])
        lp = completion_logprobs(entries, 0 if body.echo else len(gen.prompt_text)) if want else None
        text = gen.prompt_text + gen.text if body.echo else gen.text
        out.append(S.CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=gen.finish_reason))
    return S.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
                                choices=out, usage=usage(gens, body.n))


def _completion_chunks(body: G.CompletionRequest, rows: int) -> Choice:
    """A streamed completion's choice maker: it keeps each row's character offset for text_offset."""
    offsets = [0] * rows

    def chunk(i: int, d: TextDelta, head: bool, reason: str | None) -> S.CompletionChunkChoice:
        text, entries = d.text, d.logprobs or []
        if head:
            offsets[i] = 0 if body.echo else len(d.prompt_text or "")
            if body.echo:
                text, entries = (d.prompt_text or "") + text, (d.prompt_logprobs or []) + entries
        lp = completion_logprobs(entries, offsets[i]) if body.logprobs is not None else None
        offsets[i] += sum(len(e.token) for e in entries)
        return S.CompletionChunkChoice(index=i, text=text, logprobs=lp, finish_reason=reason)

    return chunk


@router.post("/v1/chat/completions", response_model=S.ChatCompletionResponse)
async def chat(body: G.ChatCompletionRequest, request: Request, state: State,
               t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    check_texts(state.limits, [m.text() for m in body.messages])
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(state.limits, body, body.max_completion_tokens or body.max_tokens, logprobs=top)
    params = replace(params, constraint=T.call_constraint(body) or params.constraint)
    messages, tools = [m.as_dict() for m in body.messages], T.tools_for_prompt(body)
    choices = per_choice(params, body.n)
    ticket = state.tenant_gate.admit(t)
    if body.stream:
        return await stream(request, state.metrics, body, [
            state.backend.complete_stream(body.model, p, messages=messages, tools=tools, tenant=share(t))
            for p in choices], S.ChatCompletionChunk, "chatcmpl", _chat_chunks(body, top), ticket)
    with ticket:
        gens = await while_connected(request, gather_all(
            state.backend.complete(body.model, p, messages=messages, tools=tools, tenant=share(t)) for p in choices))
        ticket.tokens = usage(gens, body.n).total_tokens
    out = []
    for i, gen in enumerate(gens):
        count_tokens(state.metrics, body.model, gen, first=i % body.n == 0)
        content, calls = T.read_calls(body, gen.text)
        out.append(S.ChatChoice(index=i, message=T.tool_message(body, content, calls),
                                logprobs=chat_logprobs(gen.logprobs, top),
                                finish_reason=T.finish_reason(body, calls, gen.finish_reason)))
    return S.ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
                                    choices=out, usage=usage(gens, body.n))


def _chat_chunks(body: G.ChatCompletionRequest, top: int | None) -> Choice:
    """A streamed chat's choice maker: each choice's text goes through its StreamedCalls, which holds back what may
    be a tool call (None: nothing to send for this piece)."""
    calls: dict[int, T.StreamedCalls] = {}

    def chunk(i: int, d: TextDelta, head: bool, reason: str | None) -> S.ChatChunkChoice | None:
        split = calls.setdefault(i, T.StreamedCalls(body))
        delta = split.piece(d.text)
        if reason is not None:
            last, reason = split.end(reason)
            delta = _merged(delta, last)
        if delta is None and reason is None and not d.logprobs:
            return None
        delta = delta or S.ChatDelta()
        if head:
            delta.role = "assistant"
        return S.ChatChunkChoice(index=i, delta=delta, logprobs=chat_logprobs(d.logprobs, top), finish_reason=reason)

    return chunk


def _merged(a: S.ChatDelta | None, b: S.ChatDelta | None) -> S.ChatDelta | None:
    """Two deltas of one chunk (a piece's content, then what the end releases)."""
    if a is None or b is None:
        return a or b
    content = (a.content or "") + (b.content or "")
    return S.ChatDelta(content=content or None, tool_calls=a.tool_calls or b.tool_calls,
                       function_call=a.function_call or b.function_call)


def _sampling(limits: LimitsConfig, body: G._Sampling, max_tokens: int | None, logprobs: int | None = None,
              echo: bool = False) -> SamplingParams:
    """The request's sampling fields as the engine takes them, once max_tokens is within the server's limit."""
    check_max_tokens(limits, max_tokens)
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=tuple((int(k), v) for k, v in sorted((body.logit_bias or {}).items(), key=lambda kv: int(kv[0]))),
        seed=body.seed, stop=body.stops(), stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_str_in_output=body.include_stop_str_in_output, min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, constraint=body.constraint(),
        logprobs=logprobs, echo=echo)


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """A prompt's n choices: choice j draws from seed + j (unseeded choices draw independently)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + j) for j in range(n)]


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> S.CompletionLogprobs:
    """OpenAI's legacy shape. Each position's top alternatives include the token taken there, as OpenAI's do
    (so up to logprobs + 1 of them); text_offset counts characters from the start of the prompt."""
    out = S.CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append(None if e.logprob is None else {**dict(e.top), e.token: e.logprob})
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


def chat_logprobs(entries: list[TokenLogprob] | None, top: int | None) -> S.ChatLogprobs | None:
    if top is None or entries is None:
        return None
    return S.ChatLogprobs(content=[S.ChatTokenLogprob(
        token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
        top_logprobs=[S.TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in e.top[:top]])
        for e in entries])
