"""OpenTelemetry for acb: a span per request and metrics named by the GenAI semantic conventions,
through the OpenTelemetry API (a core dependency), at no cost when no SDK is configured.

- An application that configures OpenTelemetry itself gets acb's spans and metrics with no
  call here. :func:`configure` sets the SDK up for those who have not (extra ``otel``: the SDK
  and the OTLP exporters, http/protobuf and gRPC), reading the standard ``OTEL_*`` variables.
- **Spans**: one per request, kind INTERNAL, named ``{gen_ai.operation.name} {gen_ai.request.model}``
  (``text_completion`` for ids and text, ``chat`` for messages), the child of the span current
  at submit. It is built once the request has ended, from the times the engine recorded (never
  per token, never on the engine thread for async handles), with events ``acb.queued``,
  ``acb.scheduled``, ``acb.first_token``, ``acb.preempted``/``acb.resumed`` and
  ``acb.finished``/``acb.cancelled``/``acb.failed``.
- **Metrics**: ``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token``,
  ``gen_ai.server.time_per_output_token`` and ``gen_ai.client.token.usage`` (the only token
  metric the conventions define; ``gen_ai.token.type`` input/output), with the conventions'
  units and bucket boundaries (``error.type`` on the duration of cancelled and failed
  requests); and the engines' gauges and
  counters (``acb.requests.running``, ``acb.kv_cache.*``, ``acb.prefix_cache.*``,
  ``acb.preemptions``, ``acb.engine.*``), observed from the engine's stats snapshot when a
  reader collects (nothing is recorded per step).
- **Conventions' version**: the latest GenAI conventions by default (``gen_ai.provider.name``
  on spans and metrics, content as ``gen_ai.input.messages`` / ``gen_ai.output.messages``). The
  conventions ask *existing* instrumentations to keep their v1.36 output unless
  ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``; acb is a new one, so it starts
  at the latest (that opt-in is accepted and changes nothing). ``ACB_OTEL_GENAI_CONVENTIONS=v1.36``
  (or ``configure(genai_conventions="v1.36")``) opts out to the v1.36 names (``gen_ai.system``,
  content as span events). Everything else is the same in both.
- Prompt and output text are recorded only with ``capture_content=True`` (or
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``).
- ``OTEL_SDK_DISABLED=true`` turns all of it off.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace

from acb.version import __version__

if TYPE_CHECKING:
    from acb.outputs import GenerationOutput
    from acb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROVIDER_NAME = "acb"  # gen_ai.provider.name (gen_ai.system in the v1.36 conventions)
CONVENTIONS_ENV = "ACB_OTEL_GENAI_CONVENTIONS"  # "v1.36": the opt-out to the old names
CONVENTIONS = ("latest", "v1.36")
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"

# the conventions' advised explicit bucket boundaries
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = tuple(float(4**k) for k in range(14))  # 1, 4, 16, ..., 67108864

REQUEST_DURATION = "gen_ai.server.request.duration"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
TOKEN_USAGE = "gen_ai.client.token.usage"
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], str]] = {
    REQUEST_DURATION: ("s", DURATION_BUCKETS, "submit to the request's end (any outcome)"),
    TIME_TO_FIRST_TOKEN: ("s", TTFT_BUCKETS, "submit to the first generated token (queue and prefill)"),
    TIME_PER_OUTPUT_TOKEN: ("s", TPOT_BUCKETS, "(duration - time to first token) / (output tokens - 1)"),
    TOKEN_USAGE: ("{token}", TOKEN_BUCKETS, "prompt (input) and generated (output) tokens per request"),
}

# perf_counter() -> epoch nanoseconds (the engine's times are perf_counter values)
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _wall_ns(t: float) -> int:
    return int(t * 1e9) + _EPOCH_OFFSET_NS


# ------------------------------------------------------------------ switches
def disabled() -> bool:
    """``OTEL_SDK_DISABLED=true``: acb records nothing at all."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


_conventions: str | None = None  # set by configure(genai_conventions=...); None: the environment decides
_warned_conventions: set[str] = set()


def conventions() -> str:
    """The GenAI conventions' version acb emits: ``"latest"`` (the default) or ``"v1.36"``
    (``configure(genai_conventions="v1.36")``, else ``ACB_OTEL_GENAI_CONVENTIONS=v1.36``).
    ``OTEL_SEMCONV_STABILITY_OPT_IN`` is how *existing* instrumentations are moved to the latest
    conventions; acb starts there, so that variable does not change what it emits."""
    if _conventions is not None:
        return _conventions
    value = os.environ.get(CONVENTIONS_ENV, "").strip().lower()
    if value in ("", "latest"):
        return "latest"
    if value.lstrip("v") in ("1.36", "1.36.0"):
        return "v1.36"
    if value not in _warned_conventions:
        _warned_conventions.add(value)
        logger.warning(
            "%s=%r is not one of %s: acb emits the latest GenAI conventions",
            CONVENTIONS_ENV,
            value,
            ", ".join(CONVENTIONS),
        )
    return "latest"


def latest_conventions() -> bool:
    """Whether the latest GenAI conventions are emitted (see :func:`conventions`)."""
    return conventions() == "latest"


_capture_content: bool | None = None  # set by configure(); None: the environment decides


def capture_content() -> bool:
    if _capture_content is not None:
        return _capture_content
    return os.environ.get(CAPTURE_ENV, "").strip().lower() in ("true", "1", "span_only", "span_and_event")


def _provider_attr() -> tuple[str, str]:
    return ("gen_ai.provider.name" if latest_conventions() else "gen_ai.system"), PROVIDER_NAME


def _tracing() -> bool:
    """Whether spans would go anywhere (an SDK tracer provider is set)."""
    return not isinstance(otel_trace.get_tracer_provider(), otel_trace.ProxyTracerProvider)


def _metering() -> bool:
    """Whether measurements would go anywhere (an SDK meter provider is set)."""
    return type(otel_metrics.get_meter_provider()).__name__ not in ("_ProxyMeterProvider", "NoOpMeterProvider")


def _version() -> str:
    return __version__


# ------------------------------------------------------------------ instruments
class _Instruments:
    def __init__(self) -> None:
        meter = otel_metrics.get_meter("acb", _version())
        self.histograms: dict[str, Any] = {}
        for name, (unit, buckets, desc) in HISTOGRAMS.items():
            try:  # the advisory (API >= 1.30) gives an application's own SDK the conventions' buckets
                h = meter.create_histogram(
                    name, unit=unit, description=desc, explicit_bucket_boundaries_advisory=list(buckets)
                )
            except TypeError:
                h = meter.create_histogram(name, unit=unit, description=desc)
            self.histograms[name] = h
        obs = [
            ("acb.requests.running", "gauge", "{request}", "requests being computed", lambda s: s.running),
            ("acb.requests.waiting", "gauge", "{request}", "requests waiting to be scheduled", lambda s: s.waiting),
            ("acb.kv_cache.blocks.used", "gauge", "{block}", "KV blocks held by requests", lambda s: s.kv_blocks_used),
            ("acb.kv_cache.blocks.total", "gauge", "{block}", "KV blocks in the cache", lambda s: s.kv_blocks_total),
            (
                "acb.kv_cache.usage",
                "gauge",
                "1",
                "fraction of KV blocks held by requests",
                lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            ),
            (
                "acb.prefix_cache.hit_rate",
                "gauge",
                "1",
                "prompt tokens found in the prefix cache / looked up",
                lambda s: s.prefix_hit_rate,
            ),
            (
                "acb.prefix_cache.queries",
                "counter",
                "{token}",
                "prompt tokens looked up in the prefix cache",
                lambda s: s.prefix_queries,
            ),
            (
                "acb.prefix_cache.hits",
                "counter",
                "{token}",
                "prompt tokens found in the prefix cache",
                lambda s: s.prefix_hits,
            ),
            (
                "acb.preemptions",
                "counter",
                "{preemption}",
                "requests taken off the device for lack of KV blocks",
                lambda s: s.preemptions,
            ),
            ("acb.engine.steps", "counter", "{step}", "engine steps run", lambda s: s.steps),
            (
                "acb.engine.batch.tokens",
                "counter",
                "{token}",
                "tokens computed, by acb.token.kind (prefill, decode)",
                None,
            ),
            (
                "acb.engine.step.time",
                "counter",
                "s",
                "time in the engine's steps, by acb.step.phase (schedule, stage, compute, process)",
                None,
            ),
        ]
        for name, kind, unit, desc, read in obs:
            make = meter.create_observable_gauge if kind == "gauge" else meter.create_observable_counter
            make(name, callbacks=[_observer(name, read)], unit=unit, description=desc)


def _observer(name: str, read: Any) -> Any:
    from opentelemetry.metrics import Observation

    def callback(options: Any) -> Iterator[Any]:
        for label, engine in list(_engines.items()):
            stats = engine.stats
            if stats is None:
                continue
            attrs = {"acb.engine": label}
            if name == "acb.engine.batch.tokens":
                yield Observation(stats.prefill_tokens, {**attrs, "acb.token.kind": "prefill"})
                yield Observation(stats.decode_tokens, {**attrs, "acb.token.kind": "decode"})
            elif name == "acb.engine.step.time":
                for phase, v in (
                    ("schedule", stats.host_schedule_s),
                    ("stage", stats.host_stage_s),
                    ("compute", stats.compute_s),
                    ("process", stats.host_process_s),
                ):
                    yield Observation(v, {**attrs, "acb.step.phase": phase})
            else:
                yield Observation(read(stats), attrs)

    return callback


_instruments: _Instruments | None = None
_lock = threading.Lock()
_engines: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_engine_ids = iter(range(1 << 62))


def _get() -> _Instruments:
    global _instruments
    if _instruments is None:
        with _lock:
            if _instruments is None:
                _instruments = _Instruments()
    return _instruments


def watch_engine(engine: Any, model_name: str) -> str:
    """Report ``engine.stats`` through the observable instruments while the engine lives; its
    label (attribute ``acb.engine``) is returned."""
    label = f"{model_name}#{next(_engine_ids)}"
    if not disabled():
        _get()
        _engines[label] = engine
    return label


# ------------------------------------------------------------------ per request
@dataclass
class RequestTrace:
    """What the request's span needs that its output does not carry; made at submit."""

    operation: str  # "chat" or "text_completion"
    model: str
    params: SamplingParams
    parent: Any = None  # the OpenTelemetry context current at submit
    prompt: Any = None  # text or messages, kept only when content is captured
    extra: dict[str, Any] = field(default_factory=dict)


def begin(prompt: Any, model: str, params: SamplingParams) -> RequestTrace | None:
    """The trace of a request being submitted (None when telemetry is disabled)."""
    if disabled():
        return None
    chat = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)
    keep = prompt if isinstance(prompt, str) or chat else None
    return RequestTrace(
        "chat" if chat else "text_completion",
        model,
        params,
        otel_context.get_current(),
        keep if capture_content() else None,
    )


def end(rt: RequestTrace | None, out: GenerationOutput) -> None:
    """Record an ended request: its span and its measurements, built by a background thread
    (the caller, often the engine thread, only queues them). Never raises."""
    if rt is None or not (_metering() or _tracing()):
        return
    global _worker
    if _worker is None:
        with _lock:
            if _worker is None:
                _worker = threading.Thread(target=_work, name="acb-telemetry", daemon=True)
                _worker.start()
                import atexit

                atexit.register(flush)  # runs before the SDK's own exit hooks (registered earlier)
    _queue.put((rt, out))


def flush(timeout: float = 10.0) -> bool:
    """Wait until every ended request queued so far is recorded (spans handed to the SDK's
    processors); False on timeout. :meth:`Telemetry.force_flush` and ``shutdown`` call it."""
    if _worker is None:
        return True
    done = threading.Event()
    _queue.put(done)
    return done.wait(timeout)


def _work() -> None:
    while True:
        item = _queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        rt, out = item
        try:
            if _metering():
                _measure(rt, out)
            if _tracing():
                _span(rt, out)
        except Exception:  # noqa: BLE001 - telemetry must never cost a result
            logger.warning("recording telemetry for request %r failed", out.request_id, exc_info=True)


_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_worker: threading.Thread | None = None


def _outcome(out: GenerationOutput) -> tuple[str, str | None]:
    """(outcome, error.type): finished/None, cancelled/"cancelled", failed/the failure kind."""
    name = out.status.name.lower()
    if name == "finished":
        return name, None
    if name == "failed":
        return name, out.failure.value if out.failure is not None else "_OTHER"
    return name, name


def _samples(out: GenerationOutput) -> list[Any]:
    return list(out.samples) if out.samples else [out]


def _base_attrs(operation: str, model: str) -> dict[str, Any]:
    key, value = _provider_attr()
    return {"gen_ai.operation.name": operation, key: value, "gen_ai.request.model": model}


def request_attributes(p: SamplingParams) -> dict[str, Any]:
    """The ``gen_ai.request.*`` attributes of a request's sampling parameters (None: left out)."""
    return {
        "gen_ai.request.max_tokens": p.max_new_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k,
        "gen_ai.request.seed": p.seed,
        "gen_ai.request.frequency_penalty": p.frequency_penalty,
        "gen_ai.request.presence_penalty": p.presence_penalty,
        "gen_ai.request.stop_sequences": list(p.stop) if p.stop else None,
        "gen_ai.request.choice.count": p.n if p.n not in (None, 1) else None,
    }


def _reason(sample: Any) -> str:
    return sample.finish_reason.value if sample.finish_reason is not None else "error"


def _measure(rt: RequestTrace, out: GenerationOutput) -> None:
    inst = _get()
    base = _base_attrs(rt.operation, rt.model)
    _, error = _outcome(out)
    h = inst.histograms
    if out.total_time is not None:
        h[REQUEST_DURATION].record(out.total_time, base if error is None else {**base, "error.type": error})
    h[TOKEN_USAGE].record(len(out.prompt_ids), {**base, "gen_ai.token.type": "input"})
    generated = sum(len(s.generated_tokens) for s in _samples(out))
    h[TOKEN_USAGE].record(generated, {**base, "gen_ai.token.type": "output"})
    if error is None:  # TTFT and TPOT describe successful requests
        if out.time_to_first_token is not None:
            h[TIME_TO_FIRST_TOKEN].record(out.time_to_first_token, base)
        n = len(out.generated_tokens)
        if out.time_to_first_token is not None and out.total_time is not None and n > 1:
            h[TIME_PER_OUTPUT_TOKEN].record((out.total_time - out.time_to_first_token) / (n - 1), base)


def _span(rt: RequestTrace, out: GenerationOutput) -> None:
    from opentelemetry.trace import SpanKind, Status, StatusCode

    tracer = otel_trace.get_tracer("acb", _version())
    c = out.created_time
    attrs = {**_base_attrs(rt.operation, rt.model), **request_attributes(rt.params)}
    samples = _samples(out)
    attrs["gen_ai.response.id"] = out.request_id
    attrs["gen_ai.response.model"] = rt.model
    attrs["gen_ai.response.finish_reasons"] = [_reason(s) for s in samples]
    attrs["gen_ai.usage.input_tokens"] = len(out.prompt_ids)
    attrs["gen_ai.usage.output_tokens"] = sum(len(s.generated_tokens) for s in samples)
    attrs["gen_ai.usage.cache_read.input_tokens"] = out.num_cached_tokens
    ttft, qt, total = out.time_to_first_token, out.queue_time, out.total_time
    attrs["acb.request.queue_time"] = qt
    attrs["acb.request.time_to_first_token"] = ttft
    attrs["acb.request.prefill_time"] = ttft - qt if ttft is not None and qt is not None else None
    attrs["acb.request.decode_time"] = total - ttft if total is not None and ttft is not None else None
    attrs["acb.request.preemptions"] = out.num_preemptions
    outcome, error = _outcome(out)
    if error is not None:
        attrs["error.type"] = error
    if rt.prompt is not None and latest_conventions():
        attrs["gen_ai.input.messages"] = json.dumps(_input_messages(rt.prompt), ensure_ascii=False)
        attrs["gen_ai.output.messages"] = json.dumps(_output_messages(samples), ensure_ascii=False)
    attrs.update(rt.extra)
    end_t = c + total if total is not None else time.perf_counter()
    span = tracer.start_span(
        f"{rt.operation} {rt.model}",
        context=rt.parent,
        kind=SpanKind.INTERNAL,
        attributes={k: v for k, v in attrs.items() if v is not None},
        start_time=_wall_ns(c),
    )
    span.add_event("acb.queued", timestamp=_wall_ns(c))
    if qt is not None:
        span.add_event(
            "acb.scheduled", {"gen_ai.usage.cache_read.input_tokens": out.num_cached_tokens}, timestamp=_wall_ns(c + qt)
        )
    if ttft is not None:
        span.add_event("acb.first_token", timestamp=_wall_ns(c + ttft))
    for name, t in out.events or ():
        span.add_event(f"acb.{name}", timestamp=_wall_ns(t))
    if rt.prompt is not None and not latest_conventions():  # the v1.36 form: content as span events
        span.add_event(
            "gen_ai.content.prompt",
            {"gen_ai.prompt": json.dumps(_input_messages(rt.prompt), ensure_ascii=False)},
            timestamp=_wall_ns(c),
        )
        span.add_event(
            "gen_ai.content.completion",
            {"gen_ai.completion": json.dumps(_output_messages(samples), ensure_ascii=False)},
            timestamp=_wall_ns(end_t),
        )
    end_attrs = {"acb.request.outcome": outcome}
    if error is not None:
        end_attrs["error.type"] = error
    span.add_event(f"acb.{outcome}", end_attrs, timestamp=_wall_ns(end_t))
    if outcome == "failed":
        span.set_status(Status(StatusCode.ERROR, out.error or error))
    span.end(end_time=_wall_ns(end_t))


def _input_messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]
    return [{"role": str(m.get("role", "user")), "parts": _parts(m.get("content", ""))} for m in prompt]


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as parts: text, and images named, not inlined."""
    if isinstance(content, str) or not isinstance(content, (list, tuple)):
        return [{"type": "text", "content": str(content)}]
    out: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("image", "image_url"):
            out.append({"type": "image"})
        else:
            text = part.get("text", "") if isinstance(part, Mapping) else part
            out.append({"type": "text", "content": str(text)})
    return out


def _output_messages(samples: list[Any]) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "parts": [{"type": "text", "content": s.text or ""}], "finish_reason": _reason(s)}
        for s in samples
    ]


# ------------------------------------------------------------------ an HTTP server's span
class ServerSpan:
    """A SERVER span for one HTTP request (``acb serve``), continuing the caller's
    ``traceparent``/``tracestate``; the engine's request spans started while it is
    :meth:`active` are its children. A no-op when no tracer provider is configured."""

    def __init__(self, headers: Mapping[str, str], operation: str, model: str, attributes: Mapping[str, Any]) -> None:
        self.span: Any = None
        if disabled() or not _tracing():
            return
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        carrier = {k.lower(): v for k, v in headers.items()}
        attrs = {**_base_attrs(operation, model), **attributes}
        self.span = otel_trace.get_tracer("acb", _version()).start_span(
            f"{operation} {model}",
            context=extract(carrier),
            kind=SpanKind.SERVER,
            attributes={k: v for k, v in attrs.items() if v is not None},
        )

    def active(self) -> Any:
        """A context manager making this span current (for the submits)."""
        if self.span is None:
            return _null_context()
        return otel_trace.use_span(self.span, end_on_exit=False)

    def finish(
        self, outs: list[GenerationOutput] | None = None, error_type: str | None = None, message: str | None = None
    ) -> None:
        span = self.span
        if span is None:
            return
        self.span = None
        from opentelemetry.trace import Status, StatusCode

        if outs:
            samples = [s for o in outs for s in _samples(o)]
            span.set_attribute("gen_ai.response.finish_reasons", [_reason(s) for s in samples])
            span.set_attribute("gen_ai.usage.input_tokens", sum(len(o.prompt_ids) for o in outs))
            span.set_attribute("gen_ai.usage.output_tokens", sum(len(s.generated_tokens) for s in samples))
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", sum(o.num_cached_tokens for o in outs))
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            if error_type != "cancelled":
                span.set_status(Status(StatusCode.ERROR, message or error_type))
        span.end()


class _null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------ setting the SDK up
class Telemetry:
    """What :func:`configure` set up: flush or shut it down; render the Prometheus text."""

    def __init__(self, tracer_provider: Any, meter_provider: Any, prometheus_registry: Any) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.prometheus_registry = prometheus_registry

    def force_flush(self, timeout_s: float = 10.0) -> None:
        flush(timeout_s)
        for p in (self.tracer_provider, self.meter_provider):
            if p is not None:
                p.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop the exporters (also done at interpreter exit)."""
        flush()
        for p in (self.tracer_provider, self.meter_provider):
            if p is not None:
                p.shutdown()

    def prometheus_text(self) -> bytes:
        """The metrics in Prometheus' text format (``configure(prometheus=True)``)."""
        if self.prometheus_registry is None:
            raise RuntimeError("configure(prometheus=True) was not called")
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.prometheus_registry))


def _protocol(signal: str, protocol: str | None) -> str:
    value = (
        (
            protocol
            or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        .strip()
        .lower()
    )
    if value not in ("http/protobuf", "grpc"):
        raise ValueError(f"OTLP protocol {value!r} is not supported: use 'http/protobuf' or 'grpc'")
    return value


def sdk_missing(prometheus: bool = False) -> str | None:
    """Why :func:`configure` could not run here (the OpenTelemetry SDK, or with ``prometheus``
    its Prometheus exporter, not installed), or None. The SDK is imported in this module only."""
    try:
        import opentelemetry.sdk  # noqa: F401

        if prometheus:
            import opentelemetry.exporter.prometheus  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def otlp_endpoint_configured() -> bool:
    """Whether the environment names an OTLP endpoint (``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT``)."""
    return any(os.environ.get(f"OTEL_EXPORTER_OTLP_{s}ENDPOINT") for s in ("", "TRACES_", "METRICS_"))


def _exporter(signal: str, endpoint: str | None, protocol: str | None) -> Any:
    import importlib

    proto = _protocol(signal, protocol)
    module = f"opentelemetry.exporter.otlp.proto.{'grpc' if proto == 'grpc' else 'http'}." + (
        "trace_exporter" if signal == "TRACES" else "metric_exporter"
    )
    try:
        exporter = getattr(
            importlib.import_module(module), "OTLPSpanExporter" if signal == "TRACES" else "OTLPMetricExporter"
        )
    except ImportError as exc:
        raise ImportError(
            f"the OTLP {proto} exporter is not installed: pip install -e '.[otel]' in acb's checkout ({exc})"
        ) from None
    if not endpoint:  # the exporter reads OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT
        return exporter()
    if proto == "grpc":
        return exporter(endpoint=endpoint)
    # a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT: the signal's path is appended
    return exporter(endpoint=f"{endpoint.rstrip('/')}/v1/{signal.lower()}")


def configure(
    endpoint: str | None = None,
    protocol: str | None = None,
    service_name: str | None = None,
    *,
    traces: bool = True,
    metrics: bool = True,
    capture_content: bool = False,
    prometheus: bool = False,
    export_interval_s: float | None = None,
    genai_conventions: str | None = None,
) -> Telemetry:
    """Set up the OpenTelemetry SDK to export acb's spans and metrics over OTLP.

    ``endpoint`` is the collector's base URL (``http://localhost:4318`` for http/protobuf,
    ``http://localhost:4317`` for gRPC; ``/v1/traces`` and ``/v1/metrics`` are appended for
    http); without it the exporters read ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT``.
    ``protocol`` is ``"http/protobuf"`` or ``"grpc"`` (default: ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    else http/protobuf). ``service_name`` defaults to ``OTEL_SERVICE_NAME``, else ``"acb"``.
    ``prometheus=True`` also keeps the metrics for :meth:`Telemetry.prometheus_text` (``acb
    serve``'s ``/metrics``); with ``endpoint=None`` and no endpoint in the environment, only
    that reader is set up. ``export_interval_s`` is the metric export period (default:
    ``OTEL_METRIC_EXPORT_INTERVAL``, else 60 s). ``genai_conventions``: ``"latest"`` or
    ``"v1.36"`` (default: ``ACB_OTEL_GENAI_CONVENTIONS``, else the latest; see the module docstring).

    The providers become the global ones; if the application already set its own, acb's are
    not installed (a warning says so) and acb reports through the application's.
    """
    global _capture_content, _conventions
    if genai_conventions is not None and genai_conventions not in CONVENTIONS:
        raise ValueError(f"genai_conventions={genai_conventions!r}: expected one of {', '.join(CONVENTIONS)}")
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError(
            f"acb.telemetry.configure needs the OpenTelemetry SDK: pip install -e '.[otel]' in acb's checkout ({exc})"
        ) from None
    _capture_content = capture_content or None
    _conventions = genai_conventions
    attrs = {"service.name": service_name or os.environ.get("OTEL_SERVICE_NAME") or "acb"}
    resource = Resource.create(attrs)
    export = bool(endpoint) or otlp_endpoint_configured() or not prometheus
    tracer_provider = meter_provider = registry = None
    if traces and export:
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(_exporter("TRACES", endpoint, protocol)))
        if _tracing():
            logger.warning(
                "an OpenTelemetry tracer provider is already set: acb's spans go to it, not to %s",
                endpoint or "the configured endpoint",
            )
            tracer_provider.shutdown()
            tracer_provider = None
        else:
            otel_trace.set_tracer_provider(tracer_provider)
    if metrics:
        readers: list[Any] = []
        if export:
            interval = None if export_interval_s is None else int(export_interval_s * 1000)
            readers.append(
                PeriodicExportingMetricReader(_exporter("METRICS", endpoint, protocol), export_interval_millis=interval)
            )
        if prometheus:
            reader, registry = _prometheus_reader()
            readers.append(reader)
        views = [
            View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(buckets)))
            for name, (_, buckets, _) in HISTOGRAMS.items()
        ]
        meter_provider = MeterProvider(metric_readers=readers, resource=resource, views=views)
        if _metering():
            logger.warning("an OpenTelemetry meter provider is already set: acb's metrics go to it")
            meter_provider.shutdown()
            meter_provider = registry = None
        else:
            otel_metrics.set_meter_provider(meter_provider)
    return Telemetry(tracer_provider, meter_provider, registry)


def _prometheus_reader() -> tuple[Any, Any]:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, CollectorRegistry
    except ImportError as exc:
        raise ImportError(
            "Prometheus metrics need opentelemetry-exporter-prometheus: "
            f"pip install -e '.[serve]' in acb's checkout ({exc})"
        ) from None
    registry = CollectorRegistry()
    try:  # a registry of its own (exporter >= 0.63b0), so that several apps in a process do not clash
        return PrometheusMetricReader(registry=registry), registry
    except TypeError:
        return PrometheusMetricReader(), REGISTRY
