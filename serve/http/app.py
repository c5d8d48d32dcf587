"""FastAPI routes over an engine: auth, validation, limits, errors as one-line JSON, Prometheus metrics.

`backend` is anything with the Engine's request methods (the local Engine, or a client of a remote one),
so this module knows nothing of Ray. Completions stream as OpenAI's server-sent events when asked.
"""

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.config import ServeConfig, key_digest
from serve.engine.types import SamplingParams, TextDelta, TokenLogprob
from serve.errors import BadRequest, Forbidden, ManyfoldError, TooLarge, Unauthorized, first_error
from serve.http import schemas as S
from serve.http.drain import DrainGate, Gated
from serve.metrics import Metrics

log = logging.getLogger("manyfold.http")


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    body = S.ErrorBody(error=S.ErrorDetail(message=message, type=code, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _internal_error(rid: str) -> S.ErrorDetail:
    """Logs the exception being handled; the client gets an id to find it by, never the traceback."""
    log.exception("internal error (request %s)", rid)
    return S.ErrorDetail(message=f"internal error (request {rid})", type="internal_error", code="internal_error")


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def _log_refused(request: Request, status: int, message: str) -> None:
    """One line per refused request, no traceback (that is for internal errors): INFO for a client's mistake,
    WARNING for the server's refusals (429, 5xx)."""
    level = logging.INFO if status in (400, 401, 403, 404, 413, 422, 499) else logging.WARNING
    log.log(level, "%s %s -> %d %s (request %s)", request.method, request.url.path, status, message,
            _request_id(request))


def build_http_app(backend, config: ServeConfig, gate: DrainGate | None = None) -> FastAPI:
    """gate: the ingress's drain gate (a fresh one when None); it counts requests from arrival to their last byte."""
    app = FastAPI(title="Manyfold", version="0.1.0")
    gate = gate or DrainGate()
    metrics = Metrics()
    tenants = {k: t for t in config.tenants for k in t.key_sha256}
    limits = config.limits

    # ---- errors: one JSON body, one line
    @app.exception_handler(ManyfoldError)
    async def _manyfold_error(request: Request, e: ManyfoldError):
        headers = {"Retry-After": str(e.retry_after_s)} if hasattr(e, "retry_after_s") else None
        _log_refused(request, e.http_status, str(e))
        return _error(e.http_status, e.code, str(e), headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message = first_error(e, skip=("body",))
        _log_refused(request, 422, message)
        return _error(422, "invalid_request", message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, "not_found" if e.status_code == 404 else "http_error", str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        detail = _internal_error(_request_id(request))
        return _error(500, detail.code, detail.message)

    # ---- every request: size limit, metrics
    @app.middleware("http")
    async def _measure(request: Request, call_next):
        started = time.perf_counter()
        request.state.model = None
        request.state.request_id = request.headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_request_bytes:
            response = _error(413, TooLarge.code, f"request body of {length} bytes exceeds {limits.max_request_bytes}")
        elif request.method == "POST" and length is None and len(await request.body()) > limits.max_request_bytes:
            response = _error(413, TooLarge.code, f"request body exceeds {limits.max_request_bytes} bytes")
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        metrics.observe(request.state.model, getattr(route, "path", "unmatched"), response.status_code, started)
        response.headers["x-request-id"] = request.state.request_id
        return response

    app.add_middleware(Gated, gate=gate)  # last added: outermost, around whole responses

    # ---- auth
    def tenant(request: Request):
        if not tenants:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        t = tenants.get(key_digest(key.strip()))
        if t is None:
            raise Unauthorized("invalid API key")
        return t

    def allow(request: Request, t, model: str) -> None:
        request.state.model = model
        if t is not None and "*" not in t.models and model not in t.models:
            raise Forbidden(f"tenant '{t.name}' may not call model '{model}'")

    def admin(request: Request) -> None:
        header = request.headers.get("authorization", "")
        key = header.partition(" ")[2].strip()
        if not config.admin_key_sha256:
            raise Forbidden("admin routes are disabled (no admin key configured)")
        if not key or key_digest(key) not in config.admin_key_sha256:
            raise Unauthorized("admin key required")

    def check_texts(texts: list[str]) -> None:
        if len(texts) > limits.max_inputs:
            raise TooLarge(f"{len(texts)} inputs; at most {limits.max_inputs} per request")
        for t in texts:
            if len(t) > limits.max_input_chars:
                raise TooLarge(f"an input of {len(t)} characters; at most {limits.max_input_chars}")

    def sampling(body: S._Sampling, max_tokens: int | None, logprobs: int | None = None,
                 echo: bool = False) -> SamplingParams:
        """max_tokens None: the engine runs to the end of the context, within limits.max_tokens."""
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise BadRequest(f"max_tokens: at most {limits.max_tokens} on this server, got {max_tokens}")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              seed=body.seed, stop=body.stops(), logprobs=logprobs, echo=echo)

    # ---- routes
    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render(await backend.snapshots(), await backend.models(), in_flight=gate.in_flight)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=S.ModelList)
    async def models(t=Depends(tenant)):
        cards = [S.ModelCard(id=m.name, kind=m.kind, parent=m.base, residency=m.residency, labels=m.labels)
                 for m in await backend.models() if t is None or "*" in t.models or m.name in t.models]
        return S.ModelList(data=cards)

    async def stream(request: Request, body: S._Sampling, streams: list[AsyncIterator[TextDelta]],
                     kind: type[BaseModel], prefix: str,
                     choice: Callable[[int, TextDelta, bool, str | None], BaseModel]) -> StreamingResponse:
        """Server-sent events of `kind` chunks, each holding choice(index, delta, is_first, finish_reason) of one
        of the streams (one per prompt), as they come. The first piece of every stream is awaited before the
        response starts, so a refusal (404, 429, ...) is still an HTTP status; an error after that is a last
        `error` event before [DONE]."""
        try:
            firsts = await _all(anext(d) for d in streams)
        except BaseException:
            await _close(streams)
            raise
        envelope = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}
        rid = _request_id(request)

        async def events() -> AsyncIterator[str]:
            pieces: asyncio.Queue = asyncio.Queue()  # at most one item per token of every stream

            async def pump(i: int, d: TextDelta, deltas: AsyncIterator[TextDelta]) -> None:
                try:
                    while True:
                        pieces.put_nowait((i, d))
                        if d.final is not None:
                            return
                        d = await anext(deltas)
                except Exception as e:
                    pieces.put_nowait((i, e))

            pumps = [asyncio.create_task(pump(i, d, s)) for i, (d, s) in enumerate(zip(firsts, streams))]
            open_, started, finals = len(streams), set(), []
            try:
                while open_:
                    i, d = await pieces.get()
                    if isinstance(d, Exception):
                        raise d
                    reason = d.final.finish_reason if d.final else None
                    yield _sse(kind(**envelope, choices=[choice(i, d, i not in started, reason)]))
                    started.add(i)
                    if d.final is not None:
                        open_ -= 1
                        finals.append(d.final)
                        _count_tokens(metrics, body.model, d.final)
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(kind(**envelope, choices=[], usage=_usage(*finals)))
                yield _SSE_DONE
            except ManyfoldError as e:
                _log_refused(request, e.http_status, f"in a stream: {e}")
                yield _sse(S.ErrorBody(error=S.ErrorDetail(message=str(e), type=e.code, code=e.code)))
                yield _SSE_DONE
            except Exception:
                yield _sse(S.ErrorBody(error=_internal_error(rid)))
                yield _SSE_DONE
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)  # off the streams before they close
                await _close(streams)  # a client that left stops its rows' generation

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=S.CompletionResponse)
    async def completions(body: S.CompletionRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        prompts = body.prompts()
        if len(prompts) > limits.max_inputs:
            raise TooLarge(f"prompt: at most {limits.max_inputs} prompts per request, got {len(prompts)}")
        check_texts([p for p in prompts if isinstance(p, str)])
        params = sampling(body, body.max_tokens, logprobs=body.logprobs, echo=body.echo)
        want = body.logprobs is not None
        if body.stream:
            offsets = [0] * len(prompts)

            def chunk(i: int, d: TextDelta, head: bool, reason: str | None) -> S.CompletionChunkChoice:
                text, entries = d.text, d.logprobs or []
                if head:
                    offsets[i] = 0 if body.echo else len(d.prompt_text or "")
                    if body.echo:
                        text, entries = (d.prompt_text or "") + text, (d.prompt_logprobs or []) + entries
                lp = _completion_logprobs(entries, offsets[i]) if want else None
                offsets[i] += sum(len(e.token) for e in entries)
                return S.CompletionChunkChoice(index=i, text=text, logprobs=lp, finish_reason=reason)

            streams = [backend.complete_stream(body.model, params, prompt=p) for p in prompts]
            return await stream(request, body, streams, S.CompletionChunk, "cmpl", chunk)
        gens = await _all(backend.complete(body.model, params, prompt=p) for p in prompts)
        choices = []
        for i, gen in enumerate(gens):
            _count_tokens(metrics, body.model, gen)
            entries = ((gen.prompt_logprobs or []) if body.echo else []) + (gen.logprobs or [])
            lp = _completion_logprobs(entries, 0 if body.echo else len(gen.prompt_text)) if want else None
            text = gen.prompt_text + gen.text if body.echo else gen.text
            choices.append(S.CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=gen.finish_reason))
        return S.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
                                    choices=choices, usage=_usage(*gens))

    @app.post("/v1/chat/completions", response_model=S.ChatCompletionResponse)
    async def chat(body: S.ChatCompletionRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        check_texts([m.text() for m in body.messages])
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, body.max_completion_tokens or body.max_tokens, logprobs=top)
        messages = [{k: v for k, v in {"role": m.role, "content": m.text(), "name": m.name,
                                        "tool_call_id": m.tool_call_id}.items() if v is not None}
                    for m in body.messages]
        if body.stream:
            def chunk(i: int, d: TextDelta, head: bool, reason: str | None) -> S.ChatChunkChoice:
                return S.ChatChunkChoice(index=i, delta=S.ChatDelta(role="assistant" if head else None, content=d.text),
                                         logprobs=_chat_logprobs(d.logprobs, top), finish_reason=reason)

            return await stream(request, body, [backend.complete_stream(body.model, params, messages=messages)],
                                S.ChatCompletionChunk, "chatcmpl", chunk)
        gen = await backend.complete(body.model, params, messages=messages)
        _count_tokens(metrics, body.model, gen)
        return S.ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
            choices=[S.ChatChoice(index=0, message=S.AssistantMessage(content=gen.text),
                                  logprobs=_chat_logprobs(gen.logprobs, top), finish_reason=gen.finish_reason)],
            usage=_usage(gen))

    @app.post("/v1/classify", response_model=S.ClassifyResponse)
    async def classify(body: S.ClassifyRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_texts(texts)
        res = await backend.classify(body.model, texts, body.truncate)
        data = [S.Classification(index=i, label=res.labels[int(np.argmax(row))], probs=dict(zip(res.labels, row)))
                for i, row in enumerate(res.probs)]
        return S.ClassifyResponse(model=body.model, data=data, usage=_input_usage(res))

    @app.post("/v1/embeddings", response_model=S.EmbeddingResponse)
    async def embeddings(body: S.EmbeddingRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_texts(texts)
        result = await backend.embed(body.model, texts, body.truncate)
        vectors = np.asarray(result.vectors, dtype=np.float32)
        if body.encoding_format == "base64":
            data = [S.Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode())
                    for i, v in enumerate(vectors)]
        else:
            data = [S.Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
        return S.EmbeddingResponse(data=data, model=body.model, usage=_input_usage(result))

    @app.post("/v1/admin/variants", response_model=S.ModelCard, status_code=201)
    async def add_variant(body: S.AddVariantRequest, request: Request, _=Depends(admin)):
        request.state.model = body.name
        if not Path(body.path).is_dir():
            raise BadRequest(f"path '{body.path}' is not a directory on the server")
        info = await backend.add_variant(body.name, body.base, body.path, body.kind)
        return S.ModelCard(id=info.name, kind=info.kind, parent=info.base, residency=info.residency,
                           labels=info.labels)

    @app.delete("/v1/admin/variants/{name}")
    async def remove_variant(name: str, request: Request, _=Depends(admin)):
        request.state.model = name
        await backend.remove_variant(name)
        return {"id": name, "deleted": True}

    return app


_SSE_DONE = "data: [DONE]\n\n"


def _sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def _usage(*gens) -> S.Usage:
    prompt, completion = sum(g.prompt_tokens for g in gens), sum(len(g.token_ids) for g in gens)
    return S.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _input_usage(result) -> S.InputUsage:
    return S.InputUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens,
                        truncated_inputs=result.truncated)


async def _all(coros) -> list:
    """Every awaitable's result, in order; if one fails the others are cancelled (their rows leave the engine)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _close(streams: list[AsyncIterator]) -> None:
    for s in streams:
        await s.aclose()


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> S.CompletionLogprobs:
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


def _chat_logprobs(entries: list[TokenLogprob] | None, top: int | None) -> S.ChatLogprobs | None:
    if top is None or entries is None:
        return None
    return S.ChatLogprobs(content=[S.ChatTokenLogprob(
        token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
        top_logprobs=[S.TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in e.top[:top]])
        for e in entries])


def _count_tokens(metrics: Metrics, model: str, gen) -> None:
    label = metrics.model_label(model)
    metrics.tokens.labels(label, "prompt").inc(gen.prompt_tokens)
    metrics.tokens.labels(label, "completion").inc(len(gen.token_ids))
