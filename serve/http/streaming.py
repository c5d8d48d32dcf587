"""OpenAI's server-sent events for the generation routes: the rows of one request (one per prompt) merged
into one event stream as their tokens come, then usage if asked, then [DONE]."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from serve.engine.types import TextDelta
from serve.errors import ManyfoldError
from serve.http import generation_schemas as G
from serve.http import schemas as S
from serve.http.disconnect import while_connected
from serve.http.errors import internal_error, log_refused, manyfold_message, request_id
from serve.http.tenant_limits import Ticket
from serve.http.usage import count_tokens, usage
from serve.metrics import Metrics

SSE_DONE = "data: [DONE]\n\n"

Choice = Callable[[int, TextDelta, bool, str | None], BaseModel | None]
"""choice(index, delta, is_first, finish_reason) -> one choice of a chunk (None: nothing to send for this piece; a
piece with a finish reason always sends one). is_first: nothing of this choice was sent yet."""


async def stream(request: Request, metrics: Metrics, body: G._Sampling, streams: list[AsyncIterator[TextDelta]],
                 kind: type[BaseModel], prefix: str, choice: Choice, ticket: Ticket) -> StreamingResponse:
    """Server-sent events of `kind` chunks, each holding choice(index, delta, is_first, finish_reason) of one
    of the streams (one per prompt), as they come. The first piece of every stream is awaited before the
    response starts, so a refusal (404, 429, ...) is still an HTTP status; an error after that is a last
    `error` event before [DONE]. The tenant's ticket is given back when the last event is sent."""
    try:
        firsts = await while_connected(request, gather_all(anext(d) for d in streams))
    except BaseException:
        ticket.done()
        await close_all(streams)
        raise
    chunk = partial(kind, id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=body.model)
    events = _events(request, metrics, body, firsts, streams, chunk, choice, ticket)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(request: Request, metrics: Metrics, body: G._Sampling, firsts: list[TextDelta],
                  streams: list[AsyncIterator[TextDelta]], chunk: Callable[..., BaseModel],
                  choice: Choice, ticket: Ticket) -> AsyncIterator[str]:
    pieces: asyncio.Queue = asyncio.Queue()  # at most one item per token of every stream
    pumps = [asyncio.create_task(_pump(pieces, i, d, s)) for i, (d, s) in enumerate(zip(firsts, streams))]
    open_, started, finals = len(streams), set(), [None] * len(streams)
    latest = list(firsts)
    """Each stream's latest piece: its token counts so far."""
    options = body.stream_options or G.StreamOptions()
    try:
        while open_:
            i, d = await pieces.get()
            if isinstance(d, Exception):
                raise d
            reason = d.final.finish_reason if d.final else None
            latest[i] = d
            c = choice(i, d, i not in started, reason)
            if c is not None:
                now = usage(latest, body.n) if options.continuous_usage_stats else None  # vLLM's: so far
                yield sse(chunk(choices=[c], usage=now))
                started.add(i)
            if d.final is not None:
                open_ -= 1
                finals[i] = d.final
                first = i % body.n == 0  # its prompt's first choice: the prompt's tokens count once
                count_tokens(metrics, body.model, d.final, first=first)
                ticket.tokens += d.final.completion_tokens + (d.final.prompt_tokens if first else 0)
        if options.include_usage:
            yield sse(chunk(choices=[], usage=usage(finals, body.n)))
        yield SSE_DONE
    except ManyfoldError as e:
        log_refused(request, e.http_status, f"in a stream: {e}")
        yield sse(S.ErrorBody(error=S.ErrorDetail(message=manyfold_message(request, e), type=e.code, code=e.code)))
        yield SSE_DONE
    except Exception:
        yield sse(S.ErrorBody(error=internal_error(request_id(request))))
        yield SSE_DONE
    finally:
        ticket.done()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # off the streams before they close
        await close_all(streams)  # a client that left stops its rows' generation


async def _pump(pieces: asyncio.Queue, i: int, d: TextDelta, deltas: AsyncIterator[TextDelta]) -> None:
    """Moves row i's pieces, from d (already received) to its final one, into the shared queue; an error is
    the row's last piece."""
    try:
        while True:
            pieces.put_nowait((i, d))
            if d.final is not None:
                return
            d = await anext(deltas)
    except Exception as e:
        pieces.put_nowait((i, e))


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


async def gather_all(coros: Iterable[Awaitable]) -> list:
    """Every awaitable's result, in order; if one fails the others are cancelled (their rows leave the engine)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def close_all(streams: list[AsyncIterator]) -> None:
    for s in streams:
        await s.aclose()
