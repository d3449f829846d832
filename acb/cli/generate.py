"""``acb generate``: a batch of prompts through the engine, one JSON line per request, written as
results come in (in input order) to a file or to stdout. Ctrl-C stops it cleanly: what has
finished is written, the rest is cancelled, exit 130."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from acb.cli.common import (
    DEFAULT_OUTPUT,
    EXIT_INTERRUPTED,
    SPECIAL_IDS,
    STDOUT,
    CliError,
    PromptSpec,
    add_engine_flags,
    add_model_flags,
    add_telemetry_flags,
    check_device,
    check_paths,
    engine_config,
    load_model,
    load_tokenizer,
    non_negative_float,
    positive_int,
    run_follower,
    served_name,
    text_vocab_size,
)
from acb.distributed.tp import is_tp_follower


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate for a batch of prompts and write JSONL results",
        description=(
            "Generate for a batch of prompts with continuous batching and write one JSON line per "
            "request to --output (a file, or - for stdout), in input order, each as soon as it and "
            "every line before it have ended. Without --model, runs on acb's embedded default "
            "model: a small Llama with RANDOM weights and a byte-level tokenizer, useful to exercise "
            "and time the engine; its text is meaningless. Without --prompts, makes --num-prompts "
            "synthetic prompts of random token ids."
        ),
        epilog=(
            'Prompts file (JSONL): one JSON object per line with one of "prompt" (text, tokenized '
            'with the model\'s tokenizer), "messages" (a chat: a list of {"role", "content"} '
            "objects, rendered with the tokenizer's chat template and a generation prompt; optional "
            '"chat_template_kwargs" object) or "prompt_ids" (list of ints), and optionally "id" '
            '(kept in the output; default req_<index>) and "max_new_tokens" (overrides '
            "--max-new-tokens for that line). Blank lines are skipped. "
            "Output lines hold index (0-based position among the prompts), id, prompt_len, "
            "generated_ids, text, finish_reason, status, error. The progress bar and a summary go to "
            "stderr; tokens/s in both is the generated tokens of the requests ended so far divided by "
            "the time since the first submit. Ctrl-C stops: finished results are written (input order), "
            "the rest are cancelled and not written, and the summary says how many of each. "
            "Exit status: 0 if every request finished, 1 if any failed, 2 for bad arguments or input, "
            "130 when interrupted."
        ),
    )
    add_model_flags(p)

    pr = p.add_argument_group("prompts")
    pr.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        default=None,
        help="JSONL prompts file (see below). Default: synthetic random prompts.",
    )
    pr.add_argument(
        "--num-prompts", type=positive_int, default=64, metavar="N", help="number of synthetic prompts (default: 64)"
    )
    pr.add_argument(
        "--min-prompt-len",
        type=positive_int,
        default=16,
        metavar="N",
        help="shortest synthetic prompt, in tokens (default: 16)",
    )
    pr.add_argument(
        "--max-prompt-len",
        type=positive_int,
        default=256,
        metavar="N",
        help="longest synthetic prompt, in tokens (default: 256)",
    )
    pr.add_argument("--seed", type=int, default=0, help="seed for synthetic prompts and for sampling (default: 0)")

    sp = p.add_argument_group("sampling")
    sp.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="most tokens to generate per request (default: 64)",
    )
    sp.add_argument(
        "--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)"
    )
    sp.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens (0 = off)")
    sp.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass (1 = off)")
    sp.add_argument("--min-p", type=float, default=None, metavar="P", help="min-p truncation (0 = off)")
    sp.add_argument(
        "--repetition-penalty", type=float, default=None, metavar="X", help="transformers' repetition penalty (1 = off)"
    )
    sp.add_argument(
        "-n",
        type=positive_int,
        default=None,
        metavar="N",
        help="samples per prompt (the prompt is prefilled once); output lines gain 'samples'",
    )
    sp.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="return each token's logprob and the top K alternatives"
    )
    sp.add_argument(
        "--ignore-eos", action="store_true", help="keep generating through end-of-sequence tokens until max_new_tokens"
    )

    eng = p.add_argument_group("engine (acb.ContinuousBatchingConfig)")
    add_engine_flags(eng)
    add_telemetry_flags(p)

    out = p.add_argument_group("output")
    out.add_argument(
        "--output",
        "-o",
        metavar="FILE.jsonl",
        default=None,
        help=f"where to write results, - for stdout (default: ./{DEFAULT_OUTPUT}); stdout carries nothing else",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--verbose", "-v", action="store_true", help="log acb's info messages to stderr")
    p.set_defaults(func=cmd_generate, _parser=p)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_PROMPT_KEYS = ("prompt", "messages", "prompt_ids")


def load_prompts(path: str, tokenizer: Any) -> list[PromptSpec]:
    """Parse a JSONL prompts file; raises :class:`CliError` naming the offending line.

    Text and chats are tokenized here, with the engine's own :func:`acb.text.encode_prompt`
    (so a chat renders exactly as ``engine.submit(messages)`` would), so that a bad line is
    reported with its line number before anything runs.
    """
    from acb.text import encode_prompt, is_chat

    specs: list[PromptSpec] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CliError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise CliError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            given = [k for k in _PROMPT_KEYS if k in obj]
            if not given:
                raise CliError(f'{where}: needs "prompt" (text), "messages" (a chat) or "prompt_ids" (list of ints)')
            if len(given) > 1:
                raise CliError(
                    f'{where}: give one of "prompt", "messages", "prompt_ids", not '
                    + " and ".join(f'"{k}"' for k in given)
                )
            kind = given[0]
            if "chat_template_kwargs" in obj and kind != "messages":
                raise CliError(f'{where}: "chat_template_kwargs" only applies to "messages" lines')
            if kind == "prompt_ids":
                ids = obj["prompt_ids"]
                if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                    raise CliError(f'{where}: "prompt_ids" must be a list of ints')
            elif kind == "prompt":
                text = obj["prompt"]
                if not isinstance(text, str):
                    raise CliError(f'{where}: "prompt" must be a string')
                if tokenizer is None:
                    raise CliError(f'{where}: text prompt but no tokenizer could be loaded; use "prompt_ids"')
                ids = list(tokenizer.encode(text))
            else:
                messages, kwargs = obj["messages"], obj.get("chat_template_kwargs")
                if not is_chat(messages):
                    raise CliError(
                        f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects'
                    )
                if kwargs is not None and not isinstance(kwargs, dict):
                    raise CliError(f'{where}: "chat_template_kwargs" must be an object')
                if tokenizer is None:
                    raise CliError(f'{where}: chat prompt but no tokenizer could be loaded; use "prompt_ids"')
                try:
                    ids = encode_prompt(tokenizer, messages, kwargs)
                except ValueError as exc:  # no chat template
                    raise CliError(f"{where}: {exc}") from None
                except Exception as exc:  # noqa: BLE001 - the template itself failed (jinja, a missing key...)
                    raise CliError(f"{where}: the chat template failed: {type(exc).__name__}: {exc}") from None
            if not ids:
                raise CliError(f"{where}: the prompt is empty (a request needs at least one token)")
            max_new = obj.get("max_new_tokens")
            if max_new is not None and (not _is_int(max_new) or max_new <= 0):
                raise CliError(f'{where}: "max_new_tokens" must be a positive int, got {max_new!r}')
            rid = obj["id"] if "id" in obj else f"req_{len(specs)}"
            specs.append(PromptSpec(rid, [int(t) for t in ids], max_new, where))
    if not specs:
        raise CliError(f"--prompts: {path} holds no prompts")
    return specs


def synthetic_prompts(
    n: int, min_len: int, max_len: int, vocab_size: int, seed: int, exclude: Sequence[int] = SPECIAL_IDS
) -> list[PromptSpec]:
    """``n`` prompts of random lengths in ``[min_len, max_len]`` and random non-special ids."""
    excluded = set(exclude)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    if not allowed:
        raise CliError(f"the model's vocabulary ({vocab_size}) has no non-special token ids")
    rng = random.Random(seed)
    return [
        PromptSpec(f"req_{i}", [rng.choice(allowed) for _ in range(rng.randint(min_len, max_len))]) for i in range(n)
    ]


def _generated_count(out: Any) -> int:
    """Generated tokens of one output: every sample's with ``n > 1``."""
    return sum(len(s.generated_tokens) for s in out.samples) if out.samples else len(out.generated_tokens)


def _is_cancelled(out: Any) -> bool:
    return out.status.name == "CANCELLED"


class ResultWriter:
    """One JSON line per request, in input order: a result is written (and flushed) as soon as
    it and every request before it have ended. Cancelled requests (an interrupted run) are not
    written, so every line is a request that ran to its end: finished, or failed with ``error``."""

    def __init__(self, stream: IO[str], specs: list[PromptSpec], tokenizer: Any) -> None:
        self.stream = stream
        self.specs = specs
        self.tokenizer = tokenizer
        self.next = 0  # the first index not written (nor skipped) yet
        self.held: dict[int, Any] = {}  # ended out of order, waiting for the ones before them
        self.finished = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.first_failure: Any = None

    @property
    def written(self) -> int:
        return self.finished + self.failed

    def add(self, index: int, out: Any) -> None:
        self.held[index] = out
        while self.next in self.held:
            self._write(self.next, self.held.pop(self.next))
            self.next += 1

    def flush_held(self) -> None:
        """After an interrupt: what ended after a request that never will, still in input order."""
        for i in sorted(self.held):
            self._write(i, self.held.pop(i))

    def _write(self, index: int, out: Any) -> None:
        if _is_cancelled(out):
            return
        self.stream.write(json.dumps(_record(index, self.specs[index], out, self.tokenizer), ensure_ascii=False) + "\n")
        self.stream.flush()  # a reader (or an interrupt) only ever sees whole lines
        if out.status.name == "FAILED":
            self.failed += 1
            self.first_failure = self.first_failure or out
        else:
            self.finished += 1
        self.prompt_tokens += len(self.specs[index].prompt_ids)
        self.generated_tokens += _generated_count(out)


class _Interrupt:
    """SIGINT while requests run: the first sets a flag that the run loop polls every 0.1 s (so
    nothing is cut half-way); a second raises ``KeyboardInterrupt`` to quit at once."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag.is_set():
            raise KeyboardInterrupt
        self.flag.set()  # no printing here: the main thread may be inside a write to stderr

    def is_set(self) -> bool:
        return self.flag.is_set()


@dataclass
class RunResult:
    """What the run loop saw; the bar and the summary's tokens/s both read ``tokens / elapsed``."""

    total: int
    ended: int = 0  # finished or failed (the requests that are written)
    cancelled: int = 0
    tokens: int = 0  # generated tokens of the ended requests
    t_first_submit: float = 0.0
    t_last_result: float = 0.0
    interrupted: bool = False
    stats: Any = None  # the engine's last EngineStats

    @property
    def elapsed(self) -> float:
        """First submit to the last result that ended on its own (0 before any)."""
        return max(self.t_last_result - self.t_first_submit, 0.0)

    @property
    def rate(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0


def _sampling(args: argparse.Namespace) -> Any:
    from acb.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            n=args.n,
            logprobs=args.logprobs,
        )
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None


def run_requests(
    model: Any, specs: list[PromptSpec], cfg: Any, args: argparse.Namespace, open_output: Any, tokenizer: Any
) -> tuple[RunResult, ResultWriter]:
    """Run every request through :meth:`acb.Engine.generate_batch`, writing results as they end
    (its ``on_result``; see :class:`ResultWriter`).

    Every prompt is validated before any runs (a bad one raises ``ValueError``/``TypeError`` and
    nothing is written); ``open_output()`` is called after that. A Ctrl-C stops submitting,
    cancels what is running and queued (``generate_batch``'s ``should_stop``), and returns with
    ``interrupted`` set once every result is in; a second Ctrl-C quits at once.
    """
    from dataclasses import replace

    from acb.api.engine import Engine

    sampling = _sampling(args)
    run = RunResult(total=len(specs))
    per_prompt = [
        sampling if s.max_new_tokens is None else replace(sampling, max_new_tokens=s.max_new_tokens) for s in specs
    ]
    engine = Engine(model, cfg)
    engine.model_name = served_name(args)
    engine.start()
    bar = None
    writer: ResultWriter | None = None

    def opened() -> ResultWriter:
        nonlocal writer, bar
        if writer is None:  # the first result: every prompt was valid
            writer = ResultWriter(open_output(), specs, tokenizer)
            if not args.no_progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(specs), desc="acb generate", unit="req", dynamic_ncols=True, file=sys.stderr)
        return writer

    def on_result(i: int, out: Any) -> None:
        w = opened()
        if _is_cancelled(out):
            run.cancelled += 1
        else:
            run.ended += 1
            run.tokens += _generated_count(out)
            run.t_last_result = time.perf_counter()
            if bar is not None:
                bar.set_postfix_str(f"{run.rate:,.1f} generated tok/s", refresh=False)
                bar.update(1)
        w.add(i, out)

    try:
        with _Interrupt() as interrupt:

            def should_stop() -> bool:
                nonlocal bar
                if interrupt.is_set() and not run.interrupted:
                    run.interrupted = True
                    if bar is not None:
                        bar.close()
                        bar = None
                    print(
                        f"acb generate: interrupted: cancelling {len(specs) - run.ended - run.cancelled} running "
                        "or queued requests (Ctrl-C again to quit at once)",
                        file=sys.stderr,
                        flush=True,
                    )
                return run.interrupted

            run.t_first_submit = time.perf_counter()
            try:
                engine.generate_batch(
                    [s.prompt_ids for s in specs],
                    per_prompt,
                    progress_bar=False,
                    on_result=on_result,
                    should_stop=should_stop,
                )
            except (ValueError, TypeError) as exc:  # rejected at submit: name the prompt as its file does
                m = re.match(r"inputs\[(\d+)\]: (.*)", str(exc), re.S)
                if m is None:
                    raise
                i = int(m.group(1))
                raise CliError(f"{specs[i].describe(i)}: {m.group(2)}") from None
        writer = opened()
        if run.interrupted:
            writer.flush_held()
    finally:
        if bar is not None:
            bar.close()
        engine.shutdown()
        run.stats = engine.stats
    return run, writer


def _record(index: int, spec: PromptSpec, out: Any, tokenizer: Any) -> dict[str, Any]:
    gen = [int(t) for t in out.generated_tokens]
    text = tokenizer.decode(gen, skip_special_tokens=True) if tokenizer is not None else None
    rec = {
        "index": index,
        "id": spec.id,
        "prompt_len": len(spec.prompt_ids),
        "generated_ids": gen,
        "text": text,
        "finish_reason": out.finish_reason.value if out.finish_reason is not None else None,
        "status": out.status.name,
        "error": out.error,
    }
    if out.logprobs:
        rec["logprobs"] = out.logprobs
    if out.top_logprobs is not None:
        rec["top_logprobs"] = out.top_logprobs
    if out.samples is not None:
        rec["samples"] = [
            {
                "generated_ids": s.generated_tokens,
                "text": tokenizer.decode(s.generated_tokens, skip_special_tokens=True)
                if tokenizer is not None
                else None,
                "finish_reason": s.finish_reason.value if s.finish_reason is not None else None,
                **({"logprobs": s.logprobs} if s.logprobs else {}),
            }
            for s in out.samples
        ]
    return rec


def cmd_generate(args: argparse.Namespace) -> int:
    """Run ``acb generate`` (parsed arguments in, exit status out).

    Args:
        args: the parsed command line (``acb generate --help``).

    Returns:
        The exit status: 0 all finished, 1 some failed, 130 interrupted.

    Raises:
        CliError: bad input (a prompts line, a path, a model), reported as one line, status 2.
    """
    t_start = time.perf_counter()
    args.output_defaulted = args.output is None  # no -o: say where the results go when the file opens
    if args.output is None:
        args.output = DEFAULT_OUTPUT
    check_paths(args)
    device = check_device(args.device)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("acb").setLevel(logging.INFO)

    cfg = engine_config(args, seed=args.seed)
    tel = _configure_telemetry(args)
    try:
        return _generate(args, cfg, device, t_start)
    finally:
        if tel is not None:
            tel.shutdown()  # export what is left before the process exits


def _configure_telemetry(args: argparse.Namespace) -> Any:
    """OTLP export when ``--otlp-endpoint`` (or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``) is given."""
    from acb import telemetry

    if args.otlp_endpoint is None and not telemetry.otlp_endpoint_configured():
        return None
    try:
        return telemetry.configure(args.otlp_endpoint, args.otlp_protocol, capture_content=args.otel_capture_content)
    except ImportError as exc:
        raise CliError(str(exc)) from None


def _generate(args: argparse.Namespace, cfg: Any, device: str, t_start: float) -> int:
    from acb.errors import UnsupportedModelError

    tokenizer = load_tokenizer(args)
    specs = load_prompts(args.prompts, tokenizer) if args.prompts is not None else None
    model = load_model(args, device)
    if is_tp_follower(model):  # torchrun: rank 0 submits and writes the results, the other ranks follow
        return run_follower(model, cfg, tokenizer)
    vocab = text_vocab_size(model)
    if specs is None:
        exclude = set(SPECIAL_IDS) | set(getattr(tokenizer, "all_special_ids", None) or ())
        specs = synthetic_prompts(
            args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed, exclude=sorted(exclude)
        )
    else:
        for i, s in enumerate(specs):
            bad = next((t for t in s.prompt_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise CliError(f"{s.describe(i)}: token id {bad} is outside the model's vocabulary [0, {vocab})")

    to_stdout = args.output == STDOUT
    opened: list[IO[str]] = []

    def open_output() -> IO[str]:
        stream = sys.stdout if to_stdout else open(args.output, "w", encoding="utf-8")
        opened.append(stream)
        if getattr(args, "output_defaulted", False):
            print(
                f"acb generate: writing results to {os.path.abspath(args.output)} (no -o given; -o FILE.jsonl "
                "to choose, -o - for stdout)",
                file=sys.stderr,
                flush=True,
            )
        return stream

    try:
        run, writer = run_requests(model, specs, cfg, args, open_output, tokenizer)
    except (ValueError, TypeError) as exc:  # rejected at submit
        raise CliError(str(exc)) from None
    except UnsupportedModelError as exc:
        raise CliError(f"unsupported model: {exc}") from None
    finally:
        for stream in opened:
            if stream is not sys.stdout:
                stream.close()

    n = len(specs)
    lost = n - writer.written
    if run.interrupted:
        head = (
            f"acb generate: interrupted: {n} requests: {writer.finished} finished and {writer.failed} failed "
            f"(written), {lost} lost (cancelled or never started; not written)"
        )
    else:
        head = f"acb generate: {n} requests: {writer.finished} finished, {writer.failed} failed" + (
            f", {lost} cancelled (not written)" if lost else ""
        )
    w = run.elapsed
    startup = run.t_first_submit - t_start
    where = "stdout" if to_stdout else os.path.abspath(args.output)
    lines = [
        head,
        f"  prompt tokens:     {writer.prompt_tokens} (of the written results)",
        f"  generated tokens:  {writer.generated_tokens} (of the written results, every sample's with -n)",
        f"  generation time:   {w:.3f} s (first submit to last result; loading and engine start, "
        f"{startup:.2f} s, come before)",
        f"  throughput:        {run.rate:.1f} generated tokens/s (generated tokens / generation time), "
        f"{writer.written / w if w > 0 else 0.0:.2f} requests/s",
        f"  results written to {where} (input order; 'index' is the prompt's 0-based position)",
    ]
    st = run.stats
    if st is not None:
        lines.insert(
            -1,
            f"  engine:            {st.steps} steps, {st.preemptions} preemptions ({st.swapped_out_blocks} "
            f"KV blocks offloaded to host memory, {st.recomputed_preemptions} recomputed), prefix cache "
            f"hit rate {st.prefix_hit_rate:.1%}",
        )
    if writer.first_failure is not None:
        first = writer.first_failure
        lines.append(f"  first failure:     {first.request_id}: {first.error}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    if run.interrupted:
        return EXIT_INTERRUPTED
    return 1 if writer.failed or lost else 0
