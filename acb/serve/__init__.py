"""``acb serve``: an OpenAI-compatible HTTP server on :class:`acb.AsyncEngine` (extra ``serve``:
FastAPI, uvicorn, the OpenTelemetry SDK and its Prometheus exporter). :class:`ServerSettings`
(:mod:`acb.serve.settings`) is everything one server is; :func:`build_server` is the one way every
``acb serve`` server starts from them, and :func:`run` builds one and serves HTTP (or serves an
engine built in code) (:mod:`acb.serve.launch`); :func:`build_app` gives the app on an engine."""

from __future__ import annotations

from acb import telemetry

try:
    import fastapi  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"acb serve needs the serve extra: pip install -e '.[serve]' in acb's checkout ({exc})") from None
_missing = telemetry.sdk_missing(prometheus=True)  # /metrics: the SDK's Prometheus reader
if _missing is not None:  # pragma: no cover - depends on the install
    raise ImportError(f"acb serve needs the serve extra: pip install -e '.[serve]' in acb's checkout ({_missing})")

from acb.serve.app import build_app  # noqa: E402
from acb.serve.launch import Server, build_server, run  # noqa: E402
from acb.serve.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings, TelemetrySettings  # noqa: E402

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "Server",
    "ServerSettings",
    "TelemetrySettings",
    "build_app",
    "build_server",
    "run",
]
