"""OpenTelemetry metrics for acb (API only: no-op unless the application configures an SDK).

Install the ``otel`` extra and set up a ``MeterProvider`` (e.g. with the OTLP exporter) to
receive them. Recorded once per finished request, never per token:

- ``acb.requests`` (counter; attribute ``status``: finished / cancelled / failed)
- ``acb.generated_tokens`` (counter)
- ``acb.time_to_first_token`` (histogram, seconds)
- ``acb.request_duration`` (histogram, seconds; submit to final outcome)
"""

from __future__ import annotations

from typing import Any

from acb.outputs import GenerationOutput

_instruments: tuple[Any, Any, Any, Any] | None = None


def _get() -> tuple[Any, Any, Any, Any]:
    global _instruments
    if _instruments is None:
        from opentelemetry import metrics

        meter = metrics.get_meter("acb")
        _instruments = (
            meter.create_counter("acb.requests", description="requests that reached a final outcome"),
            meter.create_counter("acb.generated_tokens", description="tokens generated"),
            meter.create_histogram("acb.time_to_first_token", unit="s", description="submit to first token"),
            meter.create_histogram("acb.request_duration", unit="s", description="submit to final outcome"),
        )
    return _instruments


def record_request(out: GenerationOutput) -> None:
    """Record one request's final outcome."""
    requests, tokens, ttft, duration = _get()
    requests.add(1, {"status": out.status.name.lower()})
    if out.generated_tokens:
        tokens.add(len(out.generated_tokens))
    if out.time_to_first_token is not None:
        ttft.record(out.time_to_first_token)
    if out.total_time is not None:
        duration.record(out.total_time)
