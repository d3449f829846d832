"""``acb serve``: an OpenAI-compatible HTTP server on :class:`acb.AsyncEngine` (extra ``serve``:
FastAPI, uvicorn, the OpenTelemetry SDK and its Prometheus exporter). :func:`build_app` gives the
app; :func:`run` serves it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from acb import telemetry

try:
    import fastapi  # noqa: F401
    import uvicorn
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"acb serve needs the serve extra: pip install 'acb-batching[serve]' ({exc})") from None
_missing = telemetry.sdk_missing(prometheus=True)  # /metrics: the SDK's Prometheus reader
if _missing is not None:  # pragma: no cover - depends on the install
    raise ImportError(f"acb serve needs the serve extra: pip install 'acb-batching[serve]' ({_missing})")

import acb  # noqa: E402
from acb.serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPTS_PER_REQUEST, build_app

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app", "run"]


def run(engine: acb.AsyncEngine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
        api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, grace_period: float = 30.0,
        log_level: str = "warning", announce: Any = None, otlp_endpoint: str | None = None,
        otlp_protocol: str | None = None, capture_content: bool = False,
        trust_request_chat_template: bool = False,
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST, tool_call_parser: str | None = None,
        reasoning_parser: str | None = None) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM; then stop accepting, give in-flight requests
    ``grace_period`` seconds to finish (the rest are cancelled) and stop the engine.

    Telemetry: ``/metrics`` always (OpenTelemetry's Prometheus reader); spans and metrics over
    OTLP too when ``otlp_endpoint`` is given or ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set.
    ``trust_request_chat_template``, ``max_prompts_per_request``, ``tool_call_parser`` and
    ``reasoning_parser``: see :func:`build_app`."""
    tel = telemetry.configure(otlp_endpoint, otlp_protocol, prometheus=True, capture_content=capture_content)

    def ready() -> None:
        line = f"acb serve: {model_name!r} ready at http://{host}:{port} (OpenAI API under /v1)"
        print(line, file=announce or sys.stdout, flush=True)

    app = build_app(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes, on_ready=ready,
                    telemetry=tel, trust_request_chat_template=trust_request_chat_template,
                    max_prompts_per_request=max_prompts_per_request, grace_period=grace_period,
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=max(1, round(grace_period)),
                            access_log=False)
    try:
        _Server(config).run()
    finally:
        tel.shutdown()  # export what is left


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 after a signal-driven drain: uvicorn re-raises the signals it
    caught once it has stopped (so the process would die by SIGTERM); acb's drain is the
    intended end of the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()
