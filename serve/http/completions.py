"""OpenAI's generation routes: POST /v1/completions and /v1/chat/completions, whole or streamed, with
logprobs (and echo for completions) in the shapes OpenAI's clients parse."""

import time
import uuid

from fastapi import APIRouter, Depends, Request

from serve.config import LimitsConfig
from serve.engine.types import SamplingParams, TextDelta, TokenLogprob
from serve.errors import TooLarge
from serve.http import schemas as S
from serve.http.auth import allow, share, tenant
from serve.http.disconnect import while_connected
from serve.http.limits import check_max_tokens, check_texts
from serve.http.state import State
from serve.http.streaming import Choice, gather_all, stream
from serve.http.usage import count_tokens, usage
from serve.store.manifest import TenantEntry

router = APIRouter()


@router.post("/v1/completions", response_model=S.CompletionResponse)
async def completions(body: S.CompletionRequest, request: Request, state: State,
                      t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    prompts = body.prompts()
    if len(prompts) > state.limits.max_inputs:
        raise TooLarge(f"prompt: at most {state.limits.max_inputs} prompts per request, got {len(prompts)}")
    check_texts(state.limits, [p for p in prompts if isinstance(p, str)])
    params = _sampling(state.limits, body, body.max_tokens, logprobs=body.logprobs, echo=body.echo)
    want = body.logprobs is not None
    ticket = state.tenant_gate.admit(t)
    if body.stream:
        streams = [state.backend.complete_stream(body.model, params, prompt=p, tenant=share(t)) for p in prompts]
        return await stream(request, state.metrics, body, streams, S.CompletionChunk, "cmpl",
                            _completion_chunks(body, len(prompts)), ticket)
    with ticket:
        gens = await while_connected(request, gather_all(
            state.backend.complete(body.model, params, prompt=p, tenant=share(t)) for p in prompts))
        ticket.tokens = usage(*gens).total_tokens
    choices = []
    for i, gen in enumerate(gens):
        count_tokens(state.metrics, body.model, gen)
        entries = ((gen.prompt_logprobs or []) if body.echo else []) + (gen.logprobs or [])
        lp = completion_logprobs(entries, 0 if body.echo else len(gen.prompt_text)) if want else None
        text = gen.prompt_text + gen.text if body.echo else gen.text
        choices.append(S.CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=gen.finish_reason))
    return S.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
                                choices=choices, usage=usage(*gens))


def _completion_chunks(body: S.CompletionRequest, n_prompts: int) -> Choice:
    """A streamed completion's choice maker: it keeps each row's character offset for text_offset."""
    offsets = [0] * n_prompts

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
async def chat(body: S.ChatCompletionRequest, request: Request, state: State,
               t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    check_texts(state.limits, [m.text() for m in body.messages])
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(state.limits, body, body.max_completion_tokens or body.max_tokens, logprobs=top)
    messages = [{k: v for k, v in {"role": m.role, "content": m.text(), "name": m.name,
                                    "tool_call_id": m.tool_call_id}.items() if v is not None}
                for m in body.messages]
    ticket = state.tenant_gate.admit(t)
    if body.stream:
        def chunk(i: int, d: TextDelta, head: bool, reason: str | None) -> S.ChatChunkChoice:
            return S.ChatChunkChoice(index=i, delta=S.ChatDelta(role="assistant" if head else None, content=d.text),
                                     logprobs=chat_logprobs(d.logprobs, top), finish_reason=reason)

        return await stream(request, state.metrics, body,
                            [state.backend.complete_stream(body.model, params, messages=messages, tenant=share(t))],
                            S.ChatCompletionChunk, "chatcmpl", chunk, ticket)
    with ticket:
        gen = await while_connected(request, state.backend.complete(body.model, params, messages=messages,
                                                                    tenant=share(t)))
        ticket.tokens = usage(gen).total_tokens
    count_tokens(state.metrics, body.model, gen)
    return S.ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
        choices=[S.ChatChoice(index=0, message=S.AssistantMessage(content=gen.text),
                              logprobs=chat_logprobs(gen.logprobs, top), finish_reason=gen.finish_reason)],
        usage=usage(gen))


def _sampling(limits: LimitsConfig, body: S._Sampling, max_tokens: int | None, logprobs: int | None = None,
              echo: bool = False) -> SamplingParams:
    """The request's sampling fields as the engine takes them, once max_tokens is within the server's limit."""
    check_max_tokens(limits, max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          seed=body.seed, stop=body.stops(), logprobs=logprobs, echo=echo)


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
