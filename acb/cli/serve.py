"""``acb serve``: the OpenAI-compatible server (:mod:`acb.serve`) on one engine."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from acb.cli.common import (
    CliError,
    _add_engine_flags,
    _add_model_flags,
    _add_telemetry_flags,
    _check_device,
    _engine_config,
    _follow,
    _is_tp_follower,
    _load_model,
    _load_tokenizer,
    _model_name,
    _non_negative_float,
    _positive_int,
)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (needs the serve extra)",
        description=(
            "Serve a local checkpoint (or the embedded random-weight model) with the OpenAI API: "
            "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, plus GET /health (200 once "
            "the engine runs) and GET /metrics (Prometheus). SIGINT/SIGTERM stop accepting, let in-flight "
            "requests finish for --grace-period seconds (then cancel them) and exit 0."
        ),
    )
    src = _add_model_flags(p)
    src.add_argument("--served-model-name", metavar="NAME", default=None,
                     help="the model's name in the API (default: the checkpoint directory's name)")
    http = p.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1 (default: $ACB_API_KEY, else none)")
    http.add_argument("--max-body-bytes", type=_positive_int, default=16 << 20, metavar="N",
                      help="largest request body accepted; larger ones get 413 (default: 16 MiB)")
    http.add_argument("--grace-period", type=_non_negative_float, default=30.0, metavar="S",
                      help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default: 30)")
    http.add_argument("--max-prompts-per-request", type=_positive_int, default=1024, metavar="N",
                      help="most completions (prompts x n) one request may ask for; more get 400 (default: 1024)")
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="accept a chat template in the request (chat_template): it is code the server runs "
                           "(default: refused with 400)")
    out = p.add_argument_group("model output")
    out.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                     help="how tool calls are found in the model's text for tool_choice='auto' (hermes: Hermes, "
                          "Qwen2.5/3 <tool_call> JSON; llama3_json: Llama 3.x JSON calls). Without it, 'auto' is "
                          "refused; 'required' and named tool choices work on any model (constrained decoding)")
    out.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"), default=None,
                     help="return the model's <think>...</think> text as reasoning_content (streamed too)")
    eng = p.add_argument_group("engine (acb.ContinuousBatchingConfig)")
    eng.add_argument("--max-queue-size", type=int, default=0, metavar="N",
                     help="most requests waiting to be scheduled; more get 429 (default: 0 = unlimited)")
    _add_engine_flags(eng)
    _add_telemetry_flags(p)
    eng.add_argument("--seed", type=int, default=None, help="seed of the engine's sampling generator")
    ray = p.add_argument_group("scale-out on Ray Serve (acb/distributed/ray_serve.py; extra ray)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: --num-replicas engine replicas (one GPU each with --device cuda) "
                          "behind Ray Serve's HTTP proxy on --host/--port, each running this same command's flags")
    ray.add_argument("--num-replicas", type=_positive_int, default=None, metavar="N",
                     help="replicas (default 1; with --min/--max-replicas, the initial count)")
    ray.add_argument("--min-replicas", type=_positive_int, default=None, metavar="A",
                     help="autoscale between A and B replicas on ongoing requests")
    ray.add_argument("--max-replicas", type=_positive_int, default=None, metavar="B")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="an existing Ray cluster (ray://host:10001 or auto); default: a local Ray started here")
    ray.add_argument("--data-parallel", type=_positive_int, default=1, metavar="N",
                     help="the same as --ray --num-replicas N on a local Ray (one scale-out path for online "
                          "serving: Ray Serve)")
    p.add_argument("--verbose", "-v", action="store_true", help="log acb's info messages to stderr")
    p.set_defaults(func=cmd_serve, _parser=p, no_progress=True)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model is not None and not os.path.isdir(args.model):
        raise CliError(f"--model: not a local checkpoint directory: {args.model}")
    if args.data_parallel > 1:  # the former home-made router's flag: Ray Serve on this machine
        if args.ray or args.num_replicas is not None:
            raise CliError("--data-parallel N is --ray --num-replicas N: give one of them")
        args.ray, args.num_replicas = True, args.data_parallel
    if args.ray:
        return _serve_on_ray(args)
    device = _check_device(args.device)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.verbose:
        logging.getLogger("acb").setLevel(logging.INFO)
    try:
        import acb.serve
    except ImportError as exc:
        raise CliError(str(exc)) from None
    import acb

    cfg = _engine_config(args, max_queue_size=args.max_queue_size, seed=args.seed)
    name = _model_name(args)
    if args.model is None:
        print("acb serve: no --model: serving the embedded random-weight model (its text is meaningless) as "
              f"{name!r}", file=sys.stderr, flush=True)
    tokenizer = _load_tokenizer(args)
    model = _load_model(args, device)
    if _is_tp_follower(model):  # torchrun: rank 0 serves HTTP, the other ranks run its steps
        return _follow(model, cfg, tokenizer)
    engine = acb.AsyncEngine(model, cfg, tokenizer=tokenizer)
    acb.serve.run(engine, name, host=args.host, port=args.port, otlp_endpoint=args.otlp_endpoint,
                  otlp_protocol=args.otlp_protocol, capture_content=args.otel_capture_content, **app_options(args))
    return 0


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``acb serve``'s flags that shape its app (:func:`acb.serve.app.build_app`'s keywords): the
    same for a plain server and for each Ray Serve replica."""
    return dict(api_key=args.api_key if args.api_key is not None else os.environ.get("ACB_API_KEY"),
                max_body_bytes=args.max_body_bytes, grace_period=args.grace_period,
                trust_request_chat_template=args.trust_request_chat_template,
                max_prompts_per_request=args.max_prompts_per_request, tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser)




# flags of the Ray launcher itself, not the replicas' (each takes a value but --ray)
_LAUNCHER_FLAGS = {"--ray": 0, "--num-replicas": 1, "--min-replicas": 1, "--max-replicas": 1, "--ray-address": 1,
                   "--host": 1, "--port": 1, "--data-parallel": 1}


def _replica_argv(argv: list[str]) -> list[str]:
    """This command line without ``serve`` and the launcher's own flags: what every replica runs."""
    out: list[str] = []
    it = iter(argv[1:] if argv and argv[0] == "serve" else argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name in _LAUNCHER_FLAGS:
            if _LAUNCHER_FLAGS[name] and "=" not in a:
                next(it, None)
            continue
        out.append(a)
    return out


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``acb serve --ray``: the Ray Serve application on a local Ray (or ``--ray-address``), on
    --host/--port, until SIGINT/SIGTERM; then Serve drains and stops the replicas."""
    try:
        from acb.distributed import ray_serve
    except ImportError as exc:
        raise CliError(str(exc)) from None
    app_args = {"argv": _replica_argv(list(getattr(args, "_argv", []))), "num_replicas": args.num_replicas,
                "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                "num_gpus": 1.0 if str(args.device).startswith("cuda") else 0.0}
    ray_serve.run(app_args, host=args.host, port=args.port, address=args.ray_address, name=_model_name(args),
                  verbose=args.verbose)
    return 0
