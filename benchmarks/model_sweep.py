"""Catalogue sweep: every transformers causal-LM model type through acb, against ``model.generate``.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built
generically from the config class's defaults (:func:`acb.bench.families.tiny_config` shrinks the size fields of the
config and of its sub-configs), then greedy tokens from plain ``model.generate`` are compared
with acb's, once with the default step budget and once with ``max_batch_tokens=8`` (chunked
prefill). Each model type gets one status:

- ``exact``: acb's tokens equal ``model.generate``'s in both runs;
- ``differs``: they do not (the first differing run, prompt and position are recorded, with the
  reference's top-2 logit margin there: a margin near 0 is a near-tie, not a bug);
- ``refused``: acb's start checks refused the model (``UnsupportedModelError``), with the reason;
- ``failed``: acb raised anything else, failed a request, hung or crashed: an acb bug to report;
- ``cannot build``: the generic tiny config, the model or the reference failed (not about acb).

Each model runs in its own process (forked from a server that imported torch, transformers and acb
once) with a timeout, at most ``--jobs`` at a time, so a hang
or a crash only costs that model. A full sweep writes ``benchmarks/results/model_sweep.json``
and ``docs/MODELS.md``; regenerate both with::

    nice -n 10 python benchmarks/model_sweep.py

``--only llama,qwen3`` or ``--sample 10 --seed 0`` sweep a part (printed, not written unless
``--merge``); ``--check`` compares the statuses with the committed table and exits 1 when one
changed (CI staleness).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from acb.bench.families import FIRST_PROMPT_ID, FIXED_TOKEN_IDS, tiny_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "benchmarks" / "results" / "model_sweep.json"
DOCS_PATH = ROOT / "docs" / "MODELS.md"

STATUSES = ("exact", "differs", "refused", "failed", "cannot build")
PROMPT_LENGTHS = (5, 11, 17)
MAX_NEW_TOKENS = 8
SEED = 0
DEFAULT_TIMEOUT_S = 240.0

# --- the tiny config ---------------------------------------------------------------------------
# (acb.bench.families: one builder for this sweep and for ``acb bench --arch MODEL_TYPE``)

# --- one model (in the worker subprocess) ------------------------------------------------------


def _stage(name: str) -> None:
    # the parent reports the last stage reached when a model hangs or crashes
    if _stage_conn is not None:
        _stage_conn.send(("stage", name))


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens from plain ``model.generate``, one unpadded prompt at a time, EOS not
    stopping (the generation config has none), and each step's raw logits."""
    import torch

    tokens, logits = [], []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, len(prompt) :].tolist()
        if len(new) != MAX_NEW_TOKENS:
            raise RuntimeError(f"model.generate gave {len(new)} tokens, not {MAX_NEW_TOKENS}")
        tokens.append(new)
        logits.append([step[0].float() for step in out.logits])
    return tokens, logits


def _margin(step_logits: Any) -> float:
    top = step_logits.topk(2).values
    return float(top[0] - top[1])


# the runs of each model: name -> config fields and samples per prompt (on the path acb picks;
# a model it pages runs "own cache" too): whole prompts; chunked prefill; memory for about one
# request (preemptions, recomputes) with async batching; two samples per prompt (forked caches)
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 1),
    "chunked": ({"max_batch_tokens": 8}, 1),
    "preempt+async": ({"num_blocks": 8, "page_size": 4, "max_batch_tokens": 16, "use_async_batching": True}, 1),
    "n=2": ({}, 2),
}


def _run_acb(
    model: Any, prompts: list[list[int]], run: str = "default", runner: str | None = None
) -> tuple[list[list[int]] | str, str]:
    """acb's greedy tokens (or the error of a failed request) and the path that ran them
    ("paged", or "own cache": the model on its own cache objects); with ``n=2`` each prompt's two
    samples, one after the other."""
    from transformers import GenerationConfig

    import acb

    fields, n = RUNS[run]
    cfg = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **fields, "runner": runner})
    gen = GenerationConfig(do_sample=False, eos_token_id=FIXED_TOKEN_IDS["eos_token_id"], pad_token_id=0)
    engine = acb.Engine(model, cfg, gen)
    engine.start()
    try:
        path = "own cache" if engine.runner.own_cache_runner is not None else "paged"
        outs = engine.generate_batch(
            prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, progress_bar=False, do_sample=False, n=n
        )
    finally:
        engine.shutdown()
    result = []
    for out in outs.values():
        if out.status != acb.RequestStatus.FINISHED:
            return f"request {out.request_id} ended {out.status.name}: {out.error}", path
        result.extend([list(x.generated_tokens) for x in out.samples] if out.samples else [list(out.generated_tokens)])
    return result, path


def _exc(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:400]


def _where(e: BaseException) -> str:
    """The innermost frame of the traceback (file:line in function), for the report."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    path = f.filename
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{f.lineno} in {f.name}"


def run_model(model_type: str) -> dict[str, Any]:
    """Build ``model_type``'s tiny model and classify acb on it (runs in the worker)."""
    import logging

    import torch

    torch.set_num_threads(1)  # two processes share two cores
    logging.getLogger("acb").setLevel(logging.CRITICAL)  # a failed request is in the result already
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rec: dict[str, Any] = {
        "model_type": model_type,
        "class": _class_name(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]),
    }
    _stage("build")
    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        rec["class"] = type(model).__name__
        rec["params"] = sum(p.numel() for p in model.parameters())
        # greedy, no EOS: the reference runs all MAX_NEW_TOKENS (acb ignores EOS on its side)
        model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=1)
        vocab = int(model.config.get_text_config().vocab_size)
        prompts = _prompts(vocab)
    except Exception as e:  # noqa: BLE001 - any failure of the generic config is a result
        return {**rec, "status": "cannot build", "reason": f"tiny config/model: {_exc(e)}", "where": _where(e)}
    _stage("reference")
    try:
        ref, ref_logits = _reference(model, prompts)
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "cannot build", "reason": f"model.generate: {_exc(e)}", "where": _where(e)}
    import acb

    diffs = []
    # the path acb picks, in each of RUNS; a model it pages also runs on its own cache objects
    # (the second path), which must give the same tokens
    # (ACB_SWEEP_RUNS: a comma-separated subset of RUNS, for CI's sample)
    wanted = os.environ.get("ACB_SWEEP_RUNS")
    runs: list[tuple[str, str, str | None]] = [
        (run, run, None) for run in RUNS if wanted is None or run in wanted.split(",")
    ]
    for label, run, runner in runs:
        _stage(f"acb {label}")
        try:
            got, path = _run_acb(model, prompts, run, runner)
        except acb.UnsupportedModelError as e:
            return {**rec, "status": "refused", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - any other acb exception is a bug to report
            return {**rec, "status": "failed", "reason": f"{label} run: {_exc(e)}", "where": _where(e)}
        if isinstance(got, str):
            return {**rec, "status": "failed", "reason": f"{label} run: {got}"}
        if label == "default":
            rec["path"] = path
            if path == "paged":
                runs.append(("own cache", "default", "own_cache"))
        samples = RUNS[run][1]
        for i, (want, have) in enumerate(zip([r for r in ref for _ in range(samples)], got)):
            p = i // samples
            if want != have:
                pos = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                margin = _margin(ref_logits[p][pos]) if pos < len(ref_logits[p]) else None
                diffs.append(
                    {
                        "run": label,
                        "prompt": p,
                        "prompt_len": len(prompts[p]),
                        "position": pos,
                        "expected": want,
                        "got": have,
                        "ref_top2_margin": margin,
                    }
                )
                break
    if diffs:
        d = diffs[0]
        margin = "" if d["ref_top2_margin"] is None else f", reference top-2 logit margin {d['ref_top2_margin']:.3g}"
        runs = "+".join(sorted({x["run"] for x in diffs}))
        return {
            **rec,
            "status": "differs",
            "diffs": diffs,
            "reason": f"{runs}: first at new token {d['position']} of prompt {d['prompt']} "
            f"(len {d['prompt_len']}, {d['run']} run){margin}",
        }
    return {**rec, "status": "exact", "reason": ""}


def _class_name(value: Any) -> str:
    return value if isinstance(value, str) else "/".join(value)


# --- the sweep (parent) ------------------------------------------------------------------------


def catalogue() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` of this transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: _class_name(v) for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def sample_types(types: list[str], n: int, seed: int) -> list[str]:
    """A deterministic sample of ``n`` model types (sorted)."""
    return sorted(random.Random(seed).sample(sorted(types), min(n, len(types))))


# The modules every model needs, imported once by the fork server: each model then runs in a
# fresh fork of it (its own process, so a crash or a hang costs only that model) without paying
# the ~4 s of importing torch and transformers again.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.activations",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.integrations.flash_attention",
    "transformers.core_model_loading",
    "acb",
    "acb.runner.model_runner",
)


def _child(model_type: str, conn: Any) -> None:
    """The forked process of one model: send its stages, then its result."""
    global _stage_conn
    _stage_conn = conn
    try:
        rec = run_model(model_type)
    except Exception as e:  # noqa: BLE001 - the sweep's own bug: reported as the model's result
        rec = {"model_type": model_type, "class": "?", "status": "cannot build", "reason": f"sweep: {_exc(e)}"}
    conn.send(("result", rec))
    conn.close()


_stage_conn: Any = None


def _sweep_one(ctx: Any, model_type: str, class_name: str, timeout_s: float) -> dict[str, Any]:
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, child), daemon=True)
    t0 = time.monotonic()
    proc.start()
    child.close()
    stage, rec = "start", None
    deadline = t0 + timeout_s
    while rec is None:
        left = deadline - time.monotonic()
        if left <= 0 or not parent.poll(left):
            break
        try:
            kind, value = parent.recv()
        except EOFError:  # the process died without a result
            break
        if kind == "stage":
            stage = value
        else:
            rec = value
    if rec is None:
        proc.join(0.5)
        if proc.is_alive():
            why = f"timed out after {timeout_s:.0f} s"
            proc.kill()
        else:
            why = f"the process died (exit code {proc.exitcode})"
        proc.join()
        # a hang or a crash: where it happened decides whose it is
        status = "failed" if stage.startswith("acb") else "cannot build"
        rec = {"model_type": model_type, "class": class_name, "status": status, "reason": f"{stage}: {why}"}
    else:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    parent.close()
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def sweep(
    types: list[str], *, jobs: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, verbose: bool = True
) -> dict[str, dict[str, Any]]:
    """Run each model type in its own process (forked from a preloaded server), ``jobs`` at a time."""
    import multiprocessing

    # before the fork server starts: it and every model's process inherit these (two processes
    # share two cores, one thread each)
    os.environ.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error"
    )
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # the fork server imports this module by name to find _child
        sys.path.insert(0, here)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    classes = catalogue()
    results: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_sweep_one, ctx, t, classes.get(t, "?"), timeout_s): t for t in types}
        for fut in concurrent.futures.as_completed(futures):
            rec = fut.result()
            results[rec["model_type"]] = rec
            if verbose:
                print(
                    f"[{len(results)}/{len(types)}] {rec['model_type']:28s} {rec['status']:12s} "
                    f"{rec['seconds']:6.1f}s {rec['reason'][:110]}",
                    flush=True,
                )
    return {t: results[t] for t in sorted(results)}


def _acb_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def make_table(results: dict[str, dict[str, Any]], acb_commit: str | None = None) -> dict[str, Any]:
    import transformers

    counts = Counter(r["status"] for r in results.values())
    return {
        "transformers_version": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "acb_commit": acb_commit or _acb_commit(),
        "prompt_lengths": list(PROMPT_LENGTHS),
        "max_new_tokens": MAX_NEW_TOKENS,
        "counts": {s: counts.get(s, 0) for s in STATUSES},
        "models": results,
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(table: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in table["counts"].items())
    lines = [
        "# Model catalogue",
        "",
        "<!-- generated by benchmarks/model_sweep.py; do not edit by hand -->",
        "",
        "Every causal-LM model type of transformers "
        f"{table['transformers_version']} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(table['models'])} types), "
        "built as a tiny random float32 model from its config class's defaults (hidden size 64, 2 layers "
        "keeping one of each layer type, 4 heads, 2 KV heads, vocabulary 256, 4 experts with top-2...), "
        f"and run through acb (commit {table.get('acb_commit') or '?'}, {table['date']}) against greedy "
        f"`model.generate`: prompts of {', '.join(map(str, table['prompt_lengths']))} tokens, "
        f"{table['max_new_tokens']} new tokens, in four runs: the default step budget; `max_batch_tokens=8` "
        "(chunked prefill); memory for about one request at a time (preemptions and recomputes) with async "
        "batching; `n=2` (two samples per prompt, forked caches). **path** is the runner acb picks: `paged` (acb's paged KV cache) or `own cache` "
        "(the model on its own cache objects, as `model.generate` runs it: for models acb cannot page); a "
        "model on the paged path also runs on its own cache, and must give the same tokens there.",
        "",
        f"Counts: {counts}.",
        "",
        "- **exact**: acb's tokens equal `model.generate`'s in every run.",
        "- **differs**: they do not; the first divergence is given (a reference top-2 logit margin near 0 "
        "would be a near-tie rather than a bug).",
        "- **refused**: acb refuses the model at start (`UnsupportedModelError`), for the reason given.",
        "- **failed**: acb raised another exception, failed a request, hung or crashed: a bug.",
        "- **cannot build**: the generic tiny config, the model or `model.generate` failed (not about acb).",
        "",
        "Regenerate (about 75 s on 2 cores): `nice -n 10 python benchmarks/model_sweep.py`. "
        "`python benchmarks/model_sweep.py --check` reruns the sweep and fails when a status changed; "
        "`tests/test_model_sweep.py` checks a sample of it in CI.",
        "",
        "| model type | class | status | path | reason |",
        "|---|---|---|---|---|",
    ]
    for t, r in table["models"].items():
        lines.append(
            f"| `{t}` | {_cell(r['class'])} | {r['status']} | {r.get('path', '')} | {_cell(r.get('reason', ''))} |"
        )
    return "\n".join(lines) + "\n"


def load_table(path: Path = RESULTS_PATH) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_table(table: dict[str, Any]) -> None:
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    DOCS_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOCS_PATH.write_text(render_markdown(table))


def status_changes(results: dict[str, dict[str, Any]], committed: dict[str, Any] | None) -> list[str]:
    """The model types whose status is not the committed table's (or that it lacks)."""
    old = (committed or {}).get("models", {})
    return [
        f"{t}: {old[t]['status'] if t in old else 'absent'} -> {r['status']} ({r['reason'][:160]})"
        for t, r in results.items()
        if t not in old or old[t]["status"] != r["status"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--sample", type=int, help="a random sample of this many model types")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--jobs", type=int, default=2, help="models run in parallel")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per model")
    ap.add_argument("--check", action="store_true", help="fail if a status differs from the committed table")
    ap.add_argument("--merge", action="store_true", help="merge a partial sweep into the committed table")
    args = ap.parse_args(argv)
    cat = catalogue()
    types = sorted(cat)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in cat]
        if unknown:
            ap.error(f"not causal-LM model types of this transformers: {unknown}")
        types = sorted(wanted)
    if args.sample:
        types = sample_types(types, args.sample, args.seed)
    partial = types != sorted(cat)
    commit = _acb_commit()  # now: the acb the workers import is the checkout's at start
    t0 = time.monotonic()
    results = sweep(types, jobs=args.jobs, timeout_s=args.timeout)
    counts = Counter(r["status"] for r in results.values())
    print(
        f"{len(results)} model types in {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
    )
    committed = load_table()
    if args.check:
        changes = status_changes(results, committed)
        if not partial and committed:
            changes += [f"{t}: in the table, no longer in the catalogue" for t in committed["models"] if t not in cat]
        if changes:
            print(
                "the committed table is stale (regenerate: python benchmarks/model_sweep.py):\n  "
                + "\n  ".join(changes)
            )
            return 1
        print("the committed table is up to date")
        return 0
    if partial and not args.merge:
        return 0
    if partial and committed:
        results = {**committed["models"], **results}
        results = {t: results[t] for t in sorted(results) if t in cat}
    write_table(make_table(results, commit))
    print(f"wrote {RESULTS_PATH.relative_to(ROOT)} and {DOCS_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
