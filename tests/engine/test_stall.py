"""A stuck engine says so: requests waiting with no answer and no step for a bound fail its progress check (a
replica's health check, so Serve replaces it); an idle engine, or one that answers, never does."""

import asyncio
import threading

import pytest

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.errors import Unavailable
from serve.store.store import Store
from tests.models import write_tiny_causal


def test_requests_that_make_no_progress_fail_the_check_and_answered_ones_clear_it(tmp_path):
    store = Store(tmp_path / "store", create=True)
    store.add_base("lm", write_tiny_causal(tmp_path / "lm"))
    engine = Engine(ServeConfig(store=store.root))
    release = threading.Event()

    async def go():
        engine.check_progress(0.0)  # nothing to do: never stalled, whatever the bound
        stuck = asyncio.get_running_loop().run_in_executor(engine._compute, release.wait, 60)  # the compute thread
        answer = asyncio.ensure_future(engine.complete("lm", SamplingParams(max_tokens=2), prompt="a b"))
        while engine.scheduler.stalled_s() == 0.0:  # the request reached the scheduler and waits there
            await asyncio.sleep(0)
        engine.check_progress(3600.0)  # within the bound: healthy
        with pytest.raises(Unavailable, match=r"has had requests for \d+ s without answering one or taking a step"):
            engine.check_progress(0.0)
        release.set()
        await stuck
        await answer
        engine.check_progress(0.0)  # answered: idle again

    asyncio.run(go())
