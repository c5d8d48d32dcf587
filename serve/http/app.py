"""The HTTP app, assembled: the shared state, the routers, the error handlers and the middleware.

Routes live by concern beside this module: completions.py (OpenAI generation, streamed by streaming.py),
encoders.py (classify, embeddings), admin.py, operations.py (healthz, metrics, models). Who may call what is in
auth.py, errors as one-line JSON in errors.py, request ids, the size limit and metrics in middleware.py.
The backend is anything with the Engine's request methods, so serve/http knows nothing of Ray."""

from fastapi import FastAPI

from serve.config import ServeConfig
from serve.http import admin, completions, encoders, operations
from serve.http.drain import DrainGate, Gated
from serve.http.errors import add_error_handlers
from serve.http.middleware import BodyLimit, Measured
from serve.http.state import HttpState
from serve.metrics import Metrics


def build_http_app(backend, config: ServeConfig, gate: DrainGate | None = None, metrics: Metrics | None = None
                   ) -> FastAPI:
    """gate: the ingress's drain gate (a fresh one when None); it counts requests from arrival to their last byte.
    metrics: the ingress's (a fresh one when None), which its backend may count in too."""
    app = FastAPI(title="Manyfold", version="0.1.0")
    state = app.state.http = HttpState(backend, config, gate or DrainGate(), metrics or Metrics())
    add_error_handlers(app)
    app.add_middleware(BodyLimit, limits=state.limits)  # inside Measured, so a 413 is measured too
    app.add_middleware(Measured, metrics=state.metrics)
    app.add_middleware(Gated, gate=state.gate)  # last added: outermost, around whole responses
    for module in (operations, completions, encoders, admin):
        app.include_router(module.router)
    return app
