"""``acb serve``: the OpenAI-compatible server (:mod:`acb.serve`) on one engine."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from typing import TYPE_CHECKING, Any

from acb.cli.common import (
    CliError,
    add_engine_flags,
    add_model_flags,
    add_telemetry_flags,
    engine_config,
    model_source,
    non_negative_float,
    positive_float,
    positive_int,
)
from acb.grammar_budget import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_BYTES, DEFAULT_MAX_REPETITION

if TYPE_CHECKING:
    from acb.serve.settings import ServerSettings


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (needs the serve extra)",
        description=(
            "Serve a local checkpoint (or the embedded random-weight model) with the OpenAI API: "
            "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models, plus "
            "GET /health (200 once the engine runs) and GET /metrics (Prometheus). SIGINT/SIGTERM stop "
            "accepting, let in-flight requests finish for --grace-period seconds (then end them with an "
            "OpenAI error) and exit 0."
        ),
    )
    src = add_model_flags(p)
    src.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model's name in the API (default: the checkpoint directory's name)",
    )
    http = p.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    http.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $ACB_API_KEY, else none)"
    )
    http.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=16 << 20,
        metavar="N",
        help="largest request body accepted; larger ones get 413 (default: 16 MiB)",
    )
    http.add_argument(
        "--grace-period",
        type=non_negative_float,
        default=30.0,
        metavar="S",
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default: 30)",
    )
    http.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=1024,
        metavar="N",
        help="most completions (prompts x n) one request may ask for; more get 400 (default: 1024)",
    )
    http.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template in the request (chat_template): it is code the server runs "
        "(default: refused with 400)",
    )
    out = p.add_argument_group("model output")
    out.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="how tool calls are found in the model's text for tool_choice='auto' (hermes: Hermes, "
        "Qwen2.5/3 <tool_call> JSON; llama3_json: Llama 3.x JSON calls). Without it, 'auto' is "
        "refused; 'required' and named tool choices work on any model (constrained decoding)",
    )
    out.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        default=None,
        help="return the model's <think>...</think> text as reasoning_content (streamed too)",
    )
    media = p.add_argument_group("images (vision-language models)")
    media.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=(),
        metavar="DOMAIN",
        help="domains (and their subdomains) whose http(s) image URLs the server fetches; by default "
        "none: images must come as data: URLs",
    )
    media.add_argument(
        "--max-image-bytes", type=int, default=20 << 20, metavar="N", help="largest image, in bytes (default: 20 MiB)"
    )
    media.add_argument(
        "--max-image-pixels",
        type=int,
        default=6000 * 6000,
        metavar="N",
        help="largest image, in pixels (width x height; default: 36M)",
    )
    media.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an image URL's fetch may take (default: 5)",
    )
    rl = p.add_argument_group("a trainer elsewhere (RL)")
    rl.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve the routes a trainer drives: /pause, /resume, /is_paused, /sleep, /wake_up, "
        "/update_weights_from_disk, /init_weight_transfer, /update_weights, /close_weight_transfer, "
        "/get_world_size (behind --api-key when set; with --ray, each reaches every replica)",
    )
    rl.add_argument(
        "--weight-transfer-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="trainer addresses /init_weight_transfer may make the server connect to: IP addresses, "
        "networks (10.0.0.0/8), host names, or * for anywhere (default: loopback only)",
    )
    lora = p.add_argument_group("LoRA adapters (acb/serve/loras.py)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=(),
        metavar="NAME=PATH",
        help="PEFT adapter folders loaded at start, each served as the model NAME (the base model keeps "
        "its own name; GET /v1/models lists them)",
    )
    lora.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        metavar="N",
        help="adapters the engine holds at once (default: as many as --lora-modules, and at least 1 "
        "with --enable-lora-updates)",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=None,
        metavar="R",
        help="the largest adapter rank the engine takes (default: the engine's, 16)",
    )
    lora.add_argument(
        "--enable-lora-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which read "
        "folders on this machine (behind --api-key when set)",
    )
    eng = p.add_argument_group("engine (acb.ContinuousBatchingConfig)")
    eng.add_argument(
        "--max-queue-size",
        type=int,
        default=0,
        metavar="N",
        help="most requests waiting to be scheduled; more get 429 (default: 0 = unlimited)",
    )
    add_engine_flags(eng)
    add_telemetry_flags(p)
    eng.add_argument("--seed", type=int, default=None, help="seed of the engine's sampling generator")
    budget = p.add_argument_group(
        "structured outputs' compile budget (per request; a spec over it is a 400 naming the limit)"
    )
    budget.add_argument(
        "--grammar-compile-timeout-s",
        type=positive_float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metavar="S",
        help=f"seconds one grammar may take to compile; it is stopped then (default: {DEFAULT_COMPILE_TIMEOUT_S:g})",
    )
    budget.add_argument(
        "--grammar-max-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BYTES,
        metavar="N",
        help=f"largest schema, regex or grammar, in bytes (default: {DEFAULT_MAX_BYTES})",
    )
    budget.add_argument(
        "--grammar-max-repetition",
        type=positive_int,
        default=DEFAULT_MAX_REPETITION,
        metavar="N",
        help="how far the {m,n} counts of a spec's patterns may expand, nested counts multiplied "
        f"(default: {DEFAULT_MAX_REPETITION})",
    )
    ray = p.add_argument_group("scale-out on Ray Serve (acb/distributed/ray_serve.py; extra ray)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve through Ray Serve: --num-replicas engine replicas (one GPU each with --device cuda) "
        "behind Ray Serve's HTTP proxy on --host/--port, each built from this same command's flags",
    )
    ray.add_argument(
        "--num-replicas",
        type=positive_int,
        default=None,
        metavar="N",
        help="replicas (default 1; with --min/--max-replicas, the initial count)",
    )
    ray.add_argument(
        "--min-replicas",
        type=positive_int,
        default=None,
        metavar="A",
        help="autoscale between A and B replicas on ongoing requests",
    )
    ray.add_argument("--max-replicas", type=positive_int, default=None, metavar="B")
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="an existing Ray cluster (ray://host:10001, host:6379 or auto); default: a new local Ray "
        "started here (whatever an earlier `ray start` left in Ray's temp folder)",
    )
    ray.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="the same as --ray --num-replicas N on a local Ray (one scale-out path for online serving: Ray Serve)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="log acb's info messages to stderr")
    p.set_defaults(func=cmd_serve, _parser=p, no_progress=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """``acb serve``: the settings from the flags, then one server (:func:`acb.serve.build_server`),
    or Ray Serve replicas built from the same settings (``--ray``).

    Args:
        args: the parsed flags.

    Returns:
        The exit status (0 after a SIGINT/SIGTERM drain).

    Raises:
        CliError: a bad flag value, a missing extra, or a model that cannot load.
    """
    if args.data_parallel > 1:  # the former home-made router's flag: Ray Serve on this machine
        if args.ray or args.num_replicas is not None:
            raise CliError("--data-parallel N is --ray --num-replicas N: give one of them")
        args.ray, args.num_replicas = True, args.data_parallel
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = server_settings(args)
    if args.ray:
        return _serve_on_ray(args, settings)
    from acb.serve.launch import build_server

    try:
        server = build_server(settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        server.run()
    except RuntimeError as exc:  # a tensor-parallel follower whose engine died
        raise CliError(str(exc)) from None
    return 0


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """``acb serve``'s flags as the settings of one server (what every replica receives too).

    Args:
        args: the parsed flags of ``acb serve``.

    Returns:
        The :class:`acb.serve.settings.ServerSettings`.

    Raises:
        CliError: the serve extra is missing, or a flag's value is refused.
    """
    try:
        from acb.serve.settings import ServerSettings, TelemetrySettings
    except ImportError as exc:
        raise CliError(str(exc)) from None
    source = model_source(args)
    try:
        source.check()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return ServerSettings(
        model=source,
        engine=engine_config(
            args,
            max_queue_size=args.max_queue_size,
            seed=args.seed,
            grammar_compile_timeout_s=args.grammar_compile_timeout_s,
            grammar_max_bytes=args.grammar_max_bytes,
            grammar_max_repetition=args.grammar_max_repetition,
            **_lora_limits(args),
        ),
        name=args.served_model_name,
        api_key=args.api_key if args.api_key is not None else os.environ.get("ACB_API_KEY"),
        max_body_bytes=args.max_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        max_prompts_per_request=args.max_prompts_per_request,
        grace_period=args.grace_period,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_media_domains=tuple(args.allowed_media_domains),
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        media_fetch_timeout=args.media_fetch_timeout,
        enable_weight_updates=args.enable_weight_updates,
        weight_transfer_hosts=tuple(args.weight_transfer_hosts or ServerSettings.weight_transfer_hosts),
        lora_modules=tuple(args.lora_modules),
        enable_lora_updates=args.enable_lora_updates,
        telemetry=TelemetrySettings(args.otlp_endpoint, args.otlp_protocol, args.otel_capture_content),
        host=args.host,
        port=args.port,
        verbose=args.verbose,
    )


def _lora_module(text: str) -> tuple[str, str]:
    """``--lora-modules``' NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter folder), got {text!r}")
    return name.strip(), path.strip()


def _lora_limits(args: argparse.Namespace) -> dict[str, int]:
    """The engine's LoRA settings from the flags (none when LoRA is not asked for: the engine's defaults)."""
    limits = {}
    max_loras = args.max_loras
    if max_loras is None and (args.lora_modules or args.enable_lora_updates):
        max_loras = max(len(args.lora_modules), 1)
    if max_loras is not None:
        if max_loras < len(args.lora_modules):
            raise CliError(f"--max-loras {max_loras} is fewer than the {len(args.lora_modules)} --lora-modules")
        limits["max_loras"] = max_loras
    if args.max_lora_rank is not None:
        limits["max_lora_rank"] = args.max_lora_rank
    return limits


def _ray_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_replicas": args.num_replicas,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "num_gpus": 1.0 if str(args.device).startswith("cuda") else 0.0,
    }


def _serve_on_ray(args: argparse.Namespace, settings: ServerSettings) -> int:
    """``acb serve --ray``: the Ray Serve application on a new local Ray (or ``--ray-address``),
    on --host/--port, until SIGINT/SIGTERM; then the ingress drains (``--grace-period``) and Serve
    stops the replicas."""
    try:
        from acb.distributed import ray_serve
    except ImportError as exc:
        raise CliError(str(exc)) from None
    try:
        app = ray_serve.build_application(settings, **_ray_options(args))
    except ValueError as exc:  # (weight updates with autoscaling)
        raise CliError(str(exc)) from None
    try:
        ray_serve.run(app, settings, address=args.ray_address, replicas=args.num_replicas or args.min_replicas or 1)
    except ray_serve.RayStartError as exc:
        raise CliError(str(exc)) from None
    return 0


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acb")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def build_ray_application(args: dict[str, Any]) -> Any:
    """The Ray Serve application for a config file (``serve run`` / ``serve deploy``): ``args``
    are ``argv`` (``acb serve``'s flags, a string or a list) and optional ``num_replicas``,
    ``min_replicas``, ``max_replicas``, ``num_gpus``, ``num_cpus``::

        applications:
          - name: acb
            route_prefix: /
            import_path: acb.cli.serve:build_ray_application
            args: {argv: "--model /models/qwen3 --max-batch-tokens 4096", num_replicas: 2, num_gpus: 1}

    Args:
        args: the config file's ``args``.

    Returns:
        The bound Ray Serve application.

    Raises:
        ValueError: a bad flag (argparse's message), before any replica starts.
    """
    import contextlib
    import io

    argv = args.get("argv", [])
    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = _serve_parser().parse_args(["serve", *argv])
        settings = server_settings(parsed)
    except SystemExit:
        raise ValueError(f"acb serve flags {argv!r}: {err.getvalue().strip().splitlines()[-1]}") from None
    except CliError as exc:
        raise ValueError(f"acb serve flags {argv!r}: {exc}") from None
    from acb.distributed import ray_serve

    return ray_serve.build_application(
        settings,
        num_replicas=args.get("num_replicas"),
        min_replicas=args.get("min_replicas"),
        max_replicas=args.get("max_replicas"),
        num_gpus=float(args.get("num_gpus", 0.0)),
        num_cpus=float(args.get("num_cpus", 1.0)),
    )
