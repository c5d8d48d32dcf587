"""FastAPI routes over an engine: auth, validation, limits, errors as one-line JSON, Prometheus metrics.

`backend` is anything with the Engine's request methods (the local Engine, or a client of a remote one),
so this module knows nothing of Ray. Completions stream as OpenAI's server-sent events when asked.
"""

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
from serve.engine.types import SamplingParams, TextDelta
from serve.errors import BadRequest, Forbidden, ManyfoldError, TooLarge, Unauthorized, first_error
from serve.http import schemas as S
from serve.metrics import Metrics

log = logging.getLogger("manyfold.http")


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    body = S.ErrorBody(error=S.ErrorDetail(message=message, type=code, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _internal_error() -> S.ErrorDetail:
    """Logs the exception being handled; the client gets an id to find it by, never the traceback."""
    rid = uuid.uuid4().hex[:12]
    log.exception("internal error (request %s)", rid)
    return S.ErrorDetail(message=f"internal error (request {rid})", type="internal_error", code="internal_error")


def build_http_app(backend, config: ServeConfig) -> FastAPI:
    app = FastAPI(title="Manyfold", version="0.1.0")
    metrics = Metrics()
    tenants = {k: t for t in config.tenants for k in t.key_sha256}
    limits = config.limits

    # ---- errors: one JSON body, one line
    @app.exception_handler(ManyfoldError)
    async def _manyfold_error(request: Request, e: ManyfoldError):
        headers = {"Retry-After": str(e.retry_after_s)} if hasattr(e, "retry_after_s") else None
        return _error(e.http_status, e.code, str(e), headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _error(422, "invalid_request", first_error(e, skip=("body",)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, "not_found" if e.status_code == 404 else "http_error", str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        detail = _internal_error()
        return _error(500, detail.code, detail.message)

    # ---- every request: size limit, metrics
    @app.middleware("http")
    async def _measure(request: Request, call_next):
        started = time.perf_counter()
        request.state.model = None
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_request_bytes:
            response = _error(413, TooLarge.code, f"request body of {length} bytes exceeds {limits.max_request_bytes}")
        elif request.method == "POST" and length is None and len(await request.body()) > limits.max_request_bytes:
            response = _error(413, TooLarge.code, f"request body exceeds {limits.max_request_bytes} bytes")
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        metrics.observe(request.state.model, getattr(route, "path", "unmatched"), response.status_code, started)
        return response

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

    def sampling(body: S._Sampling, max_tokens: int | None) -> SamplingParams:
        max_tokens = max_tokens or 16
        if max_tokens > limits.max_tokens:
            raise BadRequest(f"max_tokens {max_tokens} exceeds the server's limit of {limits.max_tokens}")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              seed=body.seed, stop=body.stops())

    # ---- routes
    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render(await backend.snapshots(), await backend.models())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=S.ModelList)
    async def models(t=Depends(tenant)):
        cards = [S.ModelCard(id=m.name, kind=m.kind, parent=m.base, residency=m.residency, labels=m.labels)
                 for m in await backend.models() if t is None or "*" in t.models or m.name in t.models]
        return S.ModelList(data=cards)

    async def stream(body: S._Sampling, deltas: AsyncIterator[TextDelta], kind: type[BaseModel], prefix: str,
                     choice: Callable[[TextDelta, bool, str | None], BaseModel]) -> StreamingResponse:
        """Server-sent events of `kind` chunks, each holding choice(delta, is_first, finish_reason). The first
        piece is awaited before the response starts, so a refusal (404, 429, ...) is still an HTTP status; an
        error after that is a last `error` event before [DONE]."""
        first = await anext(deltas)
        envelope = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}

        async def events() -> AsyncIterator[str]:
            d, head = first, True
            try:
                while True:
                    reason = d.final.finish_reason if d.final else None
                    yield _sse(kind(**envelope, choices=[choice(d, head, reason)]))
                    head = False
                    if d.final is not None:
                        _count_tokens(metrics, body.model, d.final)
                        if body.stream_options and body.stream_options.include_usage:
                            yield _sse(kind(**envelope, choices=[], usage=_usage(d.final)))
                        break
                    d = await anext(deltas)
                yield _SSE_DONE
            except ManyfoldError as e:
                yield _sse(S.ErrorBody(error=S.ErrorDetail(message=str(e), type=e.code, code=e.code)))
                yield _SSE_DONE
            except Exception:
                yield _sse(S.ErrorBody(error=_internal_error()))
                yield _SSE_DONE
            finally:
                await deltas.aclose()  # a client that left stops its row's generation

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=S.CompletionResponse)
    async def completions(body: S.CompletionRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        check_texts([prompt])
        params = sampling(body, body.max_tokens)
        if body.stream:
            return await stream(body, backend.complete_stream(body.model, params, prompt=prompt), S.CompletionChunk,
                                "cmpl", lambda d, head, reason: S.CompletionChunkChoice(text=d.text,
                                                                                      finish_reason=reason))
        gen = await backend.complete(body.model, params, prompt=prompt)
        _count_tokens(metrics, body.model, gen)
        return S.CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
            choices=[S.CompletionChoice(index=0, text=gen.text, finish_reason=gen.finish_reason)],
            usage=_usage(gen))

    @app.post("/v1/chat/completions", response_model=S.ChatCompletionResponse)
    async def chat(body: S.ChatCompletionRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        check_texts([m.content for m in body.messages])
        params = sampling(body, body.max_completion_tokens or body.max_tokens)
        messages = [m.model_dump() for m in body.messages]
        if body.stream:
            def choice(d: TextDelta, head: bool, reason: str | None) -> S.ChatChunkChoice:
                return S.ChatChunkChoice(delta=S.ChatDelta(role="assistant" if head else None, content=d.text),
                                         finish_reason=reason)

            return await stream(body, backend.complete_stream(body.model, params, messages=messages),
                                S.ChatCompletionChunk, "chatcmpl", choice)
        gen = await backend.complete(body.model, params, messages=messages)
        _count_tokens(metrics, body.model, gen)
        return S.ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.model,
            choices=[S.ChatChoice(index=0, message=S.AssistantMessage(content=gen.text),
                                  finish_reason=gen.finish_reason)],
            usage=_usage(gen))

    @app.post("/v1/classify", response_model=S.ClassifyResponse)
    async def classify(body: S.ClassifyRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_texts(texts)
        labels, probs = await backend.classify(body.model, texts)
        data = []
        for i, row in enumerate(probs):
            data.append(S.Classification(index=i, label=labels[int(np.argmax(row))],
                                         probs=dict(zip(labels, row))))
        return S.ClassifyResponse(model=body.model, data=data)

    @app.post("/v1/embeddings", response_model=S.EmbeddingResponse)
    async def embeddings(body: S.EmbeddingRequest, request: Request, t=Depends(tenant)):
        allow(request, t, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_texts(texts)
        result = await backend.embed(body.model, texts)
        vectors = np.asarray(result.vectors, dtype=np.float32)
        if body.encoding_format == "base64":
            data = [S.Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode())
                    for i, v in enumerate(vectors)]
        else:
            data = [S.Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
        return S.EmbeddingResponse(data=data, model=body.model,
                                   usage=S.Usage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens))

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


def _usage(gen) -> S.Usage:
    return S.Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=len(gen.token_ids),
                   total_tokens=gen.prompt_tokens + len(gen.token_ids))


def _count_tokens(metrics: Metrics, model: str, gen) -> None:
    label = metrics.model_label(model)
    metrics.tokens.labels(label, "prompt").inc(gen.prompt_tokens)
    metrics.tokens.labels(label, "completion").inc(len(gen.token_ids))
