"""What one server is: :class:`ServerSettings`, built once (from ``acb serve``'s flags, from a Ray
Serve config's ``argv``, or in code) and handed down whole: to :func:`acb.serve.launch.build_server`,
to :func:`acb.serve.app.build_app` and to the requests' shared
:class:`~acb.serve.pipeline.ServerState`. Each setting is defined here once, with its default
and its meaning; nothing below copies the list. Plain values: the settings pickle, so a Ray Serve
replica receives what the launcher built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from acb.config import ContinuousBatchingConfig
from acb.model_source import ModelSource
from acb.serve.media import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy
from acb.serve.render_pool import DEFAULT_RENDER_THREADS, DEFAULT_RENDER_TIMEOUT
from acb.weight_transfer import LOOPBACK_HOSTS

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PROMPTS_PER_REQUEST",
    "ServerSettings",
    "TelemetrySettings",
]

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024  # completions (prompts × n) one request may ask for
DEFAULT_GRACE_PERIOD = 30.0  # acb serve's (its uvicorn's graceful timeout)


@dataclass(frozen=True)
class TelemetrySettings:
    """Where the server's spans and metrics go: OTLP to ``otlp_endpoint`` (None: the standard
    ``OTEL_EXPORTER_OTLP_*`` variables, else no export) over ``otlp_protocol``; prompt and output
    text in the spans with ``capture_content``. ``/metrics`` is always served."""

    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    capture_content: bool = False


@dataclass(frozen=True)
class ServerSettings:
    """Everything one server is (each field's meaning beside it).

    The model and engine (:func:`~acb.serve.launch.build_server` loads them; an app built on an
    engine made in code, :func:`~acb.serve.app.build_app`, reads only the name from here):
    ``model``, ``engine``, ``name``.

    The app (:func:`~acb.serve.app.build_app`, :class:`~acb.serve.pipeline.ServerState`):
    ``api_key`` … ``weight_transfer_hosts``.

    The process (:meth:`~acb.serve.launch.Server.run`): ``telemetry``, ``host``, ``port``,
    ``verbose``.
    """

    # -- the model and the engine
    model: ModelSource = field(default_factory=ModelSource)
    engine: ContinuousBatchingConfig = field(default_factory=ContinuousBatchingConfig)
    name: str | None = None  # the name in the API and telemetry; None: the model's (its directory's)
    # -- the app
    api_key: str | None = None  # the key /v1 (and a trainer's routes) require as a Bearer token; None: none
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # the largest request body; more is a 413
    # accept a chat template in the request (chat_template, or in chat_template_kwargs): the server
    # would run the client's code, so by default it is a 400
    trust_request_chat_template: bool = False
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # completions (prompts × n); more is a 400
    # seconds requests in flight get after SIGINT/SIGTERM; None: the HTTP server's own graceful
    # timeout (acb serve's, Server.run: DEFAULT_GRACE_PERIOD)
    grace_period: float | None = None
    render_timeout: float = DEFAULT_RENDER_TIMEOUT  # seconds a request's chat rendering and tokenizing may take
    render_threads: int = DEFAULT_RENDER_THREADS  # how many renderings run at once (acb.serve.render_pool)
    # how tool_choice="auto" finds tool calls in the model's text (acb.serve.tool_parsers:
    # hermes, llama3_json); None: "auto" is refused
    tool_call_parser: str | None = None
    # the model's <think> text returned as reasoning_content (acb.serve.reasoning: deepseek_r1, qwen3)
    reasoning_parser: str | None = None
    # images in requests (acb.serve.media): the domains whose http(s) image URLs are fetched (none:
    # data: URLs only), the largest image in bytes and in pixels, seconds a fetch may take
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    # the routes a trainer elsewhere drives (acb.serve.weights: pause, sleep, weight updates from
    # disk or over torch.distributed), behind api_key when one is set
    enable_weight_updates: bool = False
    # the trainer addresses (IPs, networks, host names, *) /init_weight_transfer may make the
    # server connect to (acb.serve.weights.resolve_trainer); loopback by default
    weight_transfer_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    # LoRA adapters (acb.serve.loras): (name, PEFT folder) pairs loaded when the engine starts, each
    # served as a model of that name (needs engine.max_loras >= their number); and
    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's), refused without enable_lora_updates
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_updates: bool = False
    # -- the process
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    host: str = "127.0.0.1"  # where Server.run listens
    port: int = 8000
    verbose: bool = False  # acb's info messages on stderr

    def __post_init__(self) -> None:
        for name in ("allowed_media_domains", "weight_transfer_hosts"):  # (a list given in code)
            object.__setattr__(self, name, tuple(getattr(self, name)))
        modules = self.lora_modules  # (a dict or a list of pairs given in code)
        pairs = tuple((str(n), str(p)) for n, p in (modules.items() if isinstance(modules, Mapping) else modules))
        names = [n for n, _ in pairs]
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"lora_modules: each adapter needs a name of its own, got {names}")
        object.__setattr__(self, "lora_modules", pairs)

    @property
    def served_name(self) -> str:
        """The model's name in the API and in telemetry."""
        return self.name or self.model.default_name

    @property
    def grace_seconds(self) -> float:
        """Seconds requests in flight get on SIGINT/SIGTERM when acb runs the HTTP server."""
        return DEFAULT_GRACE_PERIOD if self.grace_period is None else self.grace_period

    @property
    def media(self) -> MediaPolicy:
        """What a request's images may be (:mod:`acb.serve.media`)."""
        return MediaPolicy(
            self.allowed_media_domains, self.max_image_bytes, self.max_image_pixels, self.media_fetch_timeout
        )
