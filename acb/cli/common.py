"""What the ``acb`` subcommands share: exit statuses, the error type, the engine, model and
telemetry flags, and loading a model and its tokenizer (a local checkpoint, the embedded
default model, or a tensor-parallel one under ``torchrun``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from acb.config import ATTN_BACKENDS, SCHEDULER_TYPES
from acb.distributed.tp import follow
from acb.model_source import DTYPES, ModelSource

DEFAULT_OUTPUT = "acb_generate_out.jsonl"
STDOUT = "-"  # --output - : results on stdout, every human-facing line on stderr
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left
SPECIAL_IDS = (0, 1, 2)  # excluded from synthetic prompts (pad, bos, eos of the default tokenizer)


class CliError(Exception):
    """A user error detected after argument parsing; reported as ``parser.error`` (exit 2)."""


@dataclass
class PromptSpec:
    """One request: its output ``id``, token ids, optional own ``max_new_tokens``, and where it
    came from (``FILE:LINE`` of a ``--prompts`` line; None for a synthetic prompt)."""

    id: Any
    prompt_ids: list[int]
    max_new_tokens: int | None = None
    where: str | None = None

    def describe(self, index: int) -> str:
        """How an error names this prompt: ``FILE:LINE``, else its position and id."""
        return self.where if self.where is not None else f"prompt {index} (id {self.id!r})"


def add_engine_flags(eng: Any) -> None:
    """The ContinuousBatchingConfig fields that `generate` and `serve` both expose."""
    eng.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="token budget per step (default: resolved by the engine)",
    )
    eng.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="KV cache blocks (default: from available memory)",
    )
    eng.add_argument(
        "--page-size",
        "--block-size",
        dest="page_size",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per KV block (default: resolved by the engine)",
    )
    eng.add_argument(
        "--max-requests-per-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="most sequences in one step (default: resolved by the engine)",
    )
    eng.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="most tokens (prompt + generated) per request (default: the model's max positions)",
    )
    eng.add_argument(
        "--async-batching",
        dest="use_async_batching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (default: on for CUDA, off for CPU)",
    )
    eng.add_argument(
        "--cuda-graphs",
        dest="use_cuda_graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay CUDA graphs for decode steps (default: on for CUDA)",
    )
    eng.add_argument(
        "--prefix-caching",
        dest="allow_block_sharing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks between requests with a common prefix (default: on)",
    )
    eng.add_argument(
        "--cpu-offload-space",
        type=non_negative_float,
        default=0.0,
        metavar="GIB",
        help="GiB of host memory to offload preempted requests' KV blocks to (default: 0 = none)",
    )
    eng.add_argument(
        "--attn-backend", choices=ATTN_BACKENDS, default=None, help="attention kernels (default: the best available)"
    )
    eng.add_argument(
        "--runner",
        choices=("paged", "own_cache"),
        default=None,
        help="paged: acb's paged KV cache (refuses a model it cannot page); own_cache: the model on its own "
        "cache objects, as model.generate runs it (default: paged when the model allows it, else own_cache)",
    )
    eng.add_argument(
        "--cpu-packed-linears",
        dest="cpu_packed_linears",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU: run float32 linear layers of decode steps on oneDNN-packed weight "
        "copies (default: on for models of at least 250k linear params per layer)",
    )
    eng.add_argument(
        "--batch-invariant",
        action="store_true",
        help="CPU float32: a request's tokens and logprobs the same bits whatever shares its batch, "
        "and a trainer's forward under acb.runner.batch_invariant.enabled(model) computes them exactly "
        "(fixed-order linears and attention; slower: docs/guides/rl.md)",
    )
    eng.add_argument(
        "--scheduler",
        dest="scheduler_type",
        choices=SCHEDULER_TYPES,
        default="fifo",
        help="scheduling policy (default: fifo)",
    )


def add_model_flags(p: Any) -> Any:
    """--model, --dtype, --device (the "model" group, returned for more)."""
    src = p.add_argument_group("model")
    src.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="local checkpoint directory (model + tokenizer; nothing is downloaded). "
        "Default: the embedded random-weight model (meaningless text).",
    )
    src.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: float32)")
    src.add_argument("--device", default="cpu", help="device to run on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    return src


def add_telemetry_flags(p: Any) -> None:
    tel = p.add_argument_group("telemetry (OpenTelemetry; needs the otel extra for OTLP)")
    tel.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        default=None,
        help="export spans and metrics over OTLP to this collector base URL, e.g. http://localhost:4318 "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT and the other standard variables; none: no export)",
    )
    tel.add_argument(
        "--otlp-protocol",
        choices=["http/protobuf", "grpc"],
        default=None,
        help="OTLP protocol (default: $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf)",
    )
    tel.add_argument(
        "--otel-capture-content",
        action="store_true",
        help="record prompt and output text in the spans (off by default)",
    )


def served_name(args: argparse.Namespace) -> str:
    """The model's name in the API and in telemetry: the checkpoint directory's name, or acb-default."""
    return getattr(args, "served_model_name", None) or ModelSource(args.model).default_name


def engine_config(args: argparse.Namespace, **extra: Any) -> Any:
    """The engine's config from the shared engine flags (plus ``extra`` fields)."""
    from acb.config import ContinuousBatchingConfig

    try:
        return ContinuousBatchingConfig(
            max_batch_tokens=args.max_batch_tokens,
            num_blocks=args.num_blocks,
            page_size=args.page_size,
            max_requests_per_batch=args.max_requests_per_batch,
            max_model_len=args.max_model_len,
            use_async_batching=args.use_async_batching,
            use_cuda_graph=args.use_cuda_graph,
            allow_block_sharing=args.allow_block_sharing,
            cpu_offload_space=args.cpu_offload_space,
            attn_backend=args.attn_backend,
            runner=args.runner,
            scheduler_type=args.scheduler_type,
            cpu_packed_linears=args.cpu_packed_linears,
            batch_invariant=getattr(args, "batch_invariant", False),
            **extra,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _finite_float(text: str, *, zero_ok: bool) -> float:
    """A finite number from a flag: >= 0 when ``zero_ok``, else > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 if zero_ok else v > 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>=' if zero_ok else '>'} 0, got {text}")
    return v


def non_negative_float(text: str) -> float:
    return _finite_float(text, zero_ok=True)


def positive_float(text: str) -> float:
    return _finite_float(text, zero_ok=False)


def check_paths(args: argparse.Namespace) -> None:
    if args.prompts is not None and not os.path.isfile(args.prompts):
        raise CliError(f"--prompts: no such file: {args.prompts}")
    if args.model is not None and not os.path.isdir(args.model):
        raise CliError(f"--model: not a local checkpoint directory: {args.model}")
    parent = os.path.dirname(os.path.abspath(args.output))
    if args.output != STDOUT and not os.path.isdir(parent):
        raise CliError(f"--output: directory does not exist: {parent}")
    if args.prompts is None and args.min_prompt_len > args.max_prompt_len:
        raise CliError(
            f"--min-prompt-len ({args.min_prompt_len}) is larger than --max-prompt-len ({args.max_prompt_len})"
        )


def model_source(args: argparse.Namespace) -> ModelSource:
    """The model the flags name (``--model``, ``--dtype``, ``--device``)."""
    return ModelSource(args.model, args.dtype, args.device, progress=not getattr(args, "no_progress", True))


def check_device(device: str) -> Any:
    try:
        return ModelSource(device=device).torch_device()
    except ValueError as exc:
        raise CliError(str(exc)) from None


def load_tokenizer(args: argparse.Namespace) -> Any:
    return model_source(args).load_tokenizer(f"acb {args.command}")


def run_follower(model: Any, cfg: Any, tokenizer: Any) -> int:
    """A follower rank's whole run (:func:`acb.distributed.tp.follow`); its exit status."""
    try:
        follow(model, cfg, tokenizer)
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    return 0


def load_model(args: argparse.Namespace, device: Any) -> Any:
    try:
        return model_source(args).load_model(device)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def text_vocab_size(model: Any) -> int:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.vocab_size)
