"""A client that leaves before its answer: the work done for it stops, and it is a 499, never an error.

An ASGI server does not cancel a handler whose client has gone (uvicorn lets it run to the end and drops the
answer); it only says so through `receive`. while_connected watches for that while the answer is computed, so
a non-streaming request frees its rows at once on any server. Ray Serve's proxy cancels the handler itself:
Measured (middleware.py) counts that case."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from serve.errors import ClientGone

T = TypeVar("T")

GONE = "the client closed the request"


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """work's result; ClientGone (499) as soon as the client disconnects, with work cancelled first (its rows
    leave the engine). Both tasks are awaited on every way out, so no exception is left unretrieved."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # a no-op once done; else the client has gone, or this handler was cancelled
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientGone(GONE)


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects. The body has been read whole by now, so `receive` has nothing else
    to give (a server may still hand over an empty body message: skipped)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
