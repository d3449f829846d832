"""What constrained decoding costs (issue 29), measured against unconstrained decoding in the
same run: per step at 1, 32 and 256 running requests, with async batching off and on, and the
grammar compile time of a typical JSON schema, cold and cached.

    python benchmarks/structured_outputs.py [--vocab 32000] [--out benchmarks/results/structured_cpu.json]

The model is a tiny random Llama whose vocabulary is a byte-level BPE of ``--vocab`` tokens
trained here on generated text (no downloads): the mask's cost grows with the vocabulary, so a
realistic one matters more than the model. Every request decodes ``--tokens`` tokens
(``ignore_eos``); a constrained one matches ``[a-z ,.]{1,4096}`` (so it never completes early:
the work per token is the matcher's and the mask's, like any grammar's inside a string).
Per step: the engine's time per step (wall / steps, where steps are the launched ones), the
time the engine thread spends filling the masks, and the time the sampler spends applying them,
from timers around those two calls; tokens/s is the measure that also counts what async batching
loses when constrained requests skip a step (they wait for their token to fill their mask).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

import acb
import acb.structured as structured
from acb.core.grammar_masks import GrammarMasks
from acb.models import tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "active"],
}
REGEX = r"[a-z ,.]{1,4096}"


def bpe_tokenizer(vocab: int):
    """A byte-level BPE tokenizer of ``vocab`` tokens, trained on generated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60_000)]
    text = [
        " ".join(rng.choice(words) for _ in range(50)) + rng.choice([".", ",", "!", "?", ' "x": 1}'])
        for _ in range(20_000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


class Timers:
    """Seconds spent in the engine's mask fill and the sampler's mask apply (patched around them)."""

    def __init__(self) -> None:
        self.fill = self.apply = 0.0
        self._fill = GrammarMasks.fill
        self._apply = structured.apply_bitmask

    def __enter__(self) -> Timers:
        timers, fill, apply = self, self._fill, self._apply

        def timed_fill(masks, sched):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            fill(masks, sched)
            timers.fill += time.perf_counter() - t

        def timed_apply(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            apply(*a, **k)
            timers.apply += time.perf_counter() - t

        GrammarMasks.fill = timed_fill  # type: ignore[method-assign]
        structured.apply_bitmask = timed_apply
        return self

    def __exit__(self, *exc: object) -> None:
        GrammarMasks.fill = self._fill  # type: ignore[method-assign]
        structured.apply_bitmask = self._apply


def run(model, tok, n: int, tokens: int, async_batching: bool, constrained: bool) -> dict:
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=max(64, n * (tokens + 16) // 16 + 8),
        page_size=16,
        max_batch_tokens=max(256, n * 12),
        max_requests_per_batch=max(n, 1),
        use_async_batching=async_batching,
    )
    prompts = [tok(f"request {i} says").input_ids for i in range(n)]
    so = acb.StructuredOutputs(regex=REGEX) if constrained else None
    with acb.Engine(model, cfg, tokenizer=tok) as eng:
        eng.generate_batch(
            prompts[:2], max_new_tokens=4, ignore_eos=True, structured_outputs=so, progress_bar=False
        )  # warm-up (and the grammar's compile)
        before = eng.stats.steps
        with Timers() as tm:
            t0 = time.perf_counter()
            outs = eng.generate_batch(
                prompts, max_new_tokens=tokens, ignore_eos=True, structured_outputs=so, progress_bar=False
            )
            wall = time.perf_counter() - t0
        steps = eng.stats.steps - before
    generated = sum(len(o.generated_tokens) for o in outs.values())
    assert generated == n * tokens, generated
    return {
        "requests": n,
        "async_batching": async_batching,
        "constrained": constrained,
        "steps": steps,
        "wall_s": wall,
        "ms_per_step": 1e3 * wall / steps,
        "tokens_per_s": generated / wall,
        "fill_ms_per_step": 1e3 * tm.fill / steps,
        "apply_ms_per_step": 1e3 * tm.apply / steps,
    }


def compile_times(tok, vocab: int) -> dict:
    t0 = time.perf_counter()
    compiler = structured.GrammarCompiler(tok, vocab)
    info_s = time.perf_counter() - t0
    spec = acb.StructuredOutputs(json=SCHEMA)
    t0 = time.perf_counter()
    compiler.compile_now(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_now(acb.StructuredOutputs(json=json.dumps(SCHEMA)))  # the same schema as text: a hit
    cached = time.perf_counter() - t0
    compiler.close()
    return {"tokenizer_info_s": info_s, "schema_cold_ms": 1e3 * cold, "schema_cached_ms": 1e3 * cached}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=24, help="tokens each request decodes")
    ap.add_argument("--sizes", default="1,32,256")
    ap.add_argument("--out", default="benchmarks/results/structured_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    tok = bpe_tokenizer(args.vocab)
    print(f"tokenizer: {len(tok)} tokens ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    model = tiny_model("llama", vocab_size=len(tok)).eval()
    run(model, tok, 4, 4, False, True)  # warm-up: the first engine in a process pays one-time costs
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        for async_batching in (False, True):
            for constrained in (False, True):
                r = run(model, tok, n, args.tokens, async_batching, constrained)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr)
    comp = compile_times(tok, len(tok))
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "vocab": len(tok),
        "tokens_per_request": args.tokens,
        "regex": REGEX,
        "rows": rows,
        "compile": comp,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = [
        f"vocabulary {result['vocab']}, {result['tokens_per_request']} tokens a request, {result['date']}, "
        f"{result['machine']}",
        "",
        "| running | async batching | free: ms/step, tok/s | constrained: ms/step, tok/s | mask fill + apply, ms/step |",
        "|---|---|---|---|---|",
    ]
    rows = result["rows"]
    for free, con in zip(rows[0::2], rows[1::2]):
        lines.append(
            f"| {free['requests']} | {'on' if free['async_batching'] else 'off'} | "
            f"{free['ms_per_step']:.1f}, {free['tokens_per_s']:.0f} | {con['ms_per_step']:.1f}, "
            f"{con['tokens_per_s']:.0f} | {con['fill_ms_per_step']:.2f} + {con['apply_ms_per_step']:.2f} |"
        )
    c = result["compile"]
    lines += [
        "",
        f"Grammar compile of a 7-field JSON schema: {c['schema_cold_ms']:.1f} ms cold, "
        f"{c['schema_cached_ms']:.3f} ms cached; the compiler's one-time tokenizer scan: "
        f"{c['tokenizer_info_s']:.2f} s.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
