"""The batch-invariant mode on the own-cache path (acb.runner.batch_invariant_own): every family
acb runs on its own cache objects, checked through the engine, and the mode's cost there.

    python benchmarks/batch_invariant_own.py [--only bloom,stablelm] [--out benchmarks/results/batch_invariant_own.json]

The families: those ``benchmarks/results/model_sweep.json`` lists on the ``own cache`` path (44 of
its 180), each a tiny random float32 model from :func:`acb.bench.families.tiny_config`, one
thread (``torch.set_num_threads(1)``, ``cpu_threads=1``). For each:

- ``rule``: what :func:`acb.runner.batch_invariant_own.own_cache_refusal` says (None: covered),
  the engine's refusal;
- the measurement, with that refusal bypassed (so that every family is measured, refused or not):
  (a) ``alone_equals_batch``: a request (a 37-token prompt, 10 sampled tokens at temperature 0.9,
  seeded, processed logprobs) alone, and the same request among 16 others of 5-40 tokens, give the
  same tokens and logprob bits; (b) ``trainer_equals_engine``: the trainer's forward over the whole
  sequence (prompt + completion, one row) under ``batch_invariant.enabled(model)`` with
  ``batch_invariant.token_logprobs`` gives exactly the engine's logprobs (and the max |Δ|);
- ``mode_rows``: the form the runner chose in the mode (``OwnCacheRunner.mode_rows``: "batched",
  the path's left-padded prefill groups and stacked decode rows, proved exact by the start-up try
  :func:`acb.runner.batch_invariant_own.batched_rows_differ`; "alone", one row a call, with
  ``mode_rows_why``); (a) and (b) are measured in that form;
- ``covered``: (a) and (b) hold; ``rule_agrees``: the rule covers exactly the families the
  measurement covers, or refuses one it covers (a tiny model's shapes can agree where a real
  model's do not: ``rule_stricter``), never covers one the measurement refuses.

Throughput (``--throughput-family``, StableLM by default, at a benchmark width): 32 prompts of
16-120 tokens x 32 new tokens, greedy, ``generate_batch`` on the own-cache path, alternating,
best of ``--rounds``: ``default`` (not the mode), ``mode`` (the mode as it runs: the batched forms
where the start-up try proves them, ``mode_rows`` says which), ``mode_alone`` (the mode forced to
one row a call: ``own_cache_runner.MODE_ALONE = True``), and whether the mode's greedy tokens
are the same in both forms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import machine_info, write_json  # noqa: E402
from acb.runner import batch_invariant as bi  # noqa: E402
from acb.runner import batch_invariant_own as own  # noqa: E402
from acb.runner import own_cache_runner as ocr  # noqa: E402

TEMP = 0.9
SP = acb.SamplingParams(
    max_new_tokens=10,
    ignore_eos=True,
    do_sample=True,
    temperature=TEMP,
    top_k=0,
    top_p=1.0,
    seed=7,
    logprobs=0,
    logprobs_mode="processed",
)
OUT = ROOT / "benchmarks" / "results" / "batch_invariant_own.json"


def own_cache_families() -> list[str]:
    table = json.loads((ROOT / "benchmarks" / "results" / "model_sweep.json").read_text())
    return [k for k, v in table["models"].items() if v.get("path") == "own cache"]


def build(model_type: str) -> Any:
    from transformers import AutoModelForCausalLM

    from acb.bench.families import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


def prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    target = [rng.randrange(16, vocab) for _ in range(37)]
    others = [[rng.randrange(16, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(16)]
    return target, others


@contextlib.contextmanager
def refusal_bypassed() -> Any:
    """The engine's refusal for the own-cache path off (measure what the rule would refuse)."""
    keep = own.own_cache_refusal
    own.own_cache_refusal = lambda model: None  # type: ignore[assignment]
    try:
        yield
    finally:
        own.own_cache_refusal = keep  # type: ignore[assignment]


def run(model: Any, batch: list[list[int]], form: list[str] | None = None) -> list[tuple[list[int], torch.Tensor]]:
    """Each output's (tokens, logprobs); ``form`` gets the runner's ``mode_rows`` (and why)."""
    config = acb.ContinuousBatchingConfig(
        page_size=8, num_blocks=200, batch_invariant=True, cpu_threads=1, runner="own_cache"
    )
    with acb.Engine(model, config) as eng:
        if form is not None:
            own_runner = eng.runner.own_cache_runner
            form[:] = [str(own_runner.mode_rows), own_runner.mode_rows_why]
        eng.pause()
        handles = [eng.submit(p, SP) for p in batch]
        eng.resume()
        outs = [h.result() for h in handles]
    return [(list(o.generated_tokens), torch.tensor(o.logprobs, dtype=torch.float64)) for o in outs]


def family(model_type: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    row: dict[str, Any] = {"model_type": model_type}
    try:
        model = build(model_type)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {**row, "error": f"cannot build: {type(exc).__name__}: {exc}"[:400]}
    row["class"] = type(model).__name__
    t = time.perf_counter()
    row["rule"] = own.own_cache_refusal(model)
    row["rule_s"] = round(time.perf_counter() - t, 2)
    vocab = int(model.config.get_text_config().vocab_size)
    target, others = prompts(vocab)
    try:
        with refusal_bypassed():
            form: list[str] = []
            (alone,) = run(model, [target], form)
            row["mode_rows"] = form[0]
            if form[1]:
                row["mode_rows_why"] = form[1]
            among = run(model, [*others, target])[-1]
        row["alone_equals_batch"] = alone[0] == among[0] and torch.equal(alone[1], among[1])
        if not row["alone_equals_batch"]:
            row["batch_max_abs_diff"] = (
                float((alone[1] - among[1]).abs().max()) if alone[0] == among[0] else "tokens differ"
            )
        tokens, lps = alone
        with bi.enabled(model), torch.no_grad():
            logits = model(input_ids=torch.tensor([target + tokens])).logits
        got = bi.token_logprobs(logits[0, len(target) - 1 : -1], tokens, TEMP).double()
        row["trainer_equals_engine"] = bool(torch.equal(got, lps))
        row["trainer_max_abs_diff"] = float((got - lps).abs().max())
    except Exception as exc:  # noqa: BLE001 - recorded
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["where"] = traceback.format_exc().strip().splitlines()[-3][:200]
    covered = bool(row.get("alone_equals_batch")) and bool(row.get("trainer_equals_engine"))
    row["covered"] = covered
    rule_covers = row["rule"] is None
    row["rule_agrees"] = rule_covers == covered or (not rule_covers and covered and "rule_stricter")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def throughput(model_type: str, rounds: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from acb.bench.families import family_config

    cfg, note = family_config(
        model_type, hidden_size=256, num_hidden_layers=4, vocab_size=4096, max_position_embeddings=1024
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    rng = random.Random(1)
    batch = [[rng.randrange(16, 4096) for _ in range(rng.randrange(16, 120))] for _ in range(32)]
    new = 32
    best: dict[str, float] = {}
    chosen = None
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for side in ("default", "mode", "mode_alone"):
            ocr.MODE_ALONE = side == "mode_alone"
            config = acb.ContinuousBatchingConfig(
                page_size=16, num_blocks=400, batch_invariant=side != "default", cpu_threads=1, runner="own_cache"
            )
            try:
                with acb.Engine(model, config) as eng:
                    if side == "mode":
                        chosen = eng.runner.own_cache_runner.mode_rows
                    t = time.perf_counter()
                    outs = eng.generate_batch(
                        batch, max_new_tokens=new, ignore_eos=True, do_sample=False, progress_bar=False
                    )
                    s = time.perf_counter() - t
            finally:
                ocr.MODE_ALONE = False
            toks = sum(len(o.generated_tokens) for o in outs.values())
            best[side] = max(best.get(side, 0.0), toks / s)
            tokens[side] = [list(o.generated_tokens) for o in outs.values()]
    return {
        "model_type": model_type,
        "config": note,
        "params": sum(p.numel() for p in model.parameters()),
        "prompts": len(batch),
        "new_tokens": new,
        "rounds": rounds,
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "mode_rows": chosen,
        "mode_over_default": round(best["mode"] / best["default"], 3),
        "mode_alone_over_default": round(best["mode_alone"] / best["default"], 3),
        "mode_over_mode_alone": round(best["mode"] / best["mode_alone"], 2),
        "mode_same_tokens_as_mode_alone": tokens["mode"] == tokens["mode_alone"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (printed, not written)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--throughput-family", default="stablelm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-throughput", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else own_cache_families()
    rows = {}
    for name in names:
        row = family(name)
        rows[name] = row
        print(json.dumps(row), flush=True)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "families": rows,
        "covered": sorted(k for k, r in rows.items() if r.get("covered") and r.get("rule") is None),
        "covered_batched": sorted(
            k for k, r in rows.items() if r.get("covered") and r.get("rule") is None and r.get("mode_rows") == "batched"
        ),
        "refused": {k: r["rule"] for k, r in rows.items() if r.get("rule") is not None},
        "rule_disagrees": sorted(k for k, r in rows.items() if r.get("rule_agrees") is False),
    }
    if not args.no_throughput:
        result["throughput"] = throughput(args.throughput_family, args.rounds)
        print(json.dumps(result["throughput"]), flush=True)
    if args.only:
        return
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
