"""``acb bench eval``: lm-eval's model ``acb`` against lm-eval's own ``hf`` backend, same process.

Three local tasks shaped like the evaluations people run, generated here (no downloads), over a
random-weight model saved to a temporary directory with a tokenizer built in code: a Llama, or
with ``arch="qwen3_5"`` a Qwen3.5-shaped hybrid of the same hidden, MLP, heads and vocabulary
(gated-DeltaNet linear attention, three layers to one gated full-attention layer:
:func:`acb.bench.common.arch_config`), or any other family (``arch`` a causal-LM model type:
:mod:`acb.bench.families`; no floor then), which lm-eval's ``hf`` loads with ``AutoModelForCausalLM``:

- ``fewshot_letters`` (MMLU-like): 5-shot multiple choice (the same five examples before every
  question, lm-eval's ``first_n`` sampler, as MMLU), four one-letter answers " A".." D";
- ``endings`` (HellaSwag-like): 0-shot, four endings of several tokens each;
- ``fewshot_gen`` (GSM8K-like): 4-shot ``generate_until``, greedy, stop strings;
- ``rolling`` (WikiText-like), the held-out shape (added after the engine's scoring was tuned
  on the other three, and not tuned on): ``loglikelihood_rolling`` perplexity of long documents,
  each scored in lm-eval's disjoint windows of the model's ``max_length``.

Each task is timed on all its documents and again on the first 48 (``limit``; a task with no
more documents than that keeps its full run's figure), and the four together are timed once more
as one ``simple_evaluate`` call on 48 documents each, and the three issue 43 names together
(``three together``: letters, endings, generation; the held-out rolling task left out) as one more.

Each backend (``hf`` at batch size 16, and ``auto`` on a GPU: on a CPU its batch-size detection
alone, a forward of 64 windows of ``max_length`` tokens, takes minutes; ``acb`` with the
engine's defaults) first
runs every task on a few documents untimed (imports, dataset caches, allocator warm-up); then
each task is one timed ``lm_eval.simple_evaluate`` call (model loading included), the backends
interleaved. The run checks that the numbers agree with ``hf`` (batch 16): every loglikelihood
within 2e-4 per continuation token (float32 noise at 1,500-token contexts: a float32 forward is
that far from a float64 one however it is batched; the tests hold acb to 1e-5 per token against
a plain forward on short contexts), greedy flags, generated texts and metrics equal.

The floor: the least arithmetic the tasks need once every shared prefix is computed once (each
distinct token position of all the scored and generated sequences through the model's linear
layers and attention, the LM head on the scored rows and the generated tokens), against the
float32 matmul peak measured in the same run.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from typing import Any

import torch

from acb.bench.common import ModelSpec, matmul_peak_gflops

TASKS = ("fewshot_letters", "endings", "fewshot_gen", "rolling")
# documents per task: (fewshot_letters, endings, fewshot_gen, rolling)
DOCS = {"default": (120, 120, 16, 24), "tiny": (6, 6, 3, 2)}
# the smaller runs: each task, then all of them in one call, on the first LIMIT documents of each
LIMIT = {"default": 48, "tiny": 3}
TOGETHER = "together"  # the label of the one call on every task
# the label of the one call on the three tasks issue 43 names together (the held-out rolling task
# left out: it shares nothing, and its windows are as long as the model's context)
THREE = "three together"
COMBINED = {TOGETHER: TASKS, THREE: TASKS[:3]}
ROLLING_CHARS = {"default": (1500, 5000), "tiny": (200, 600)}  # a rolling document's length (bytes: tokens)
MAX_GEN_TOKS = {"default": 48, "tiny": 8}
# the architectures whose floor is modelled (acb.bench.common.ARCHS but the MoE: its active experts
# are not); any other family runs without a floor
EVAL_ARCHS = ("llama", "qwen3_5")
SHAPES = {
    # >= 15M parameters (the issue's 17M-parameter Llama), byte-level vocabulary
    "default": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be not are "
    "model token batch cache answer question river mountain seven blue quickly under over number "
    "many apples each costs how total left more than"
).split()
LETTERS = ("A", "B", "C", "D")


def sentence(rng: random.Random, lo: int, hi: int, words: tuple[str, ...] | list[str] = WORDS) -> str:
    """Random words, ``lo`` to ``hi`` characters (the benchmarks' stand-in for text)."""
    n = rng.randint(lo, hi)
    text = ""
    while len(text) < n:
        text += rng.choice(words) + " "
    return text[:n].strip()


def _write_tasks(folder: str, size: str) -> None:
    rng = random.Random(0)
    n_letters, n_endings, n_gen, n_rolling = DOCS[size]

    def dump(name: str, rows: list[dict[str, Any]]) -> str:
        path = os.path.join(folder, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return path

    def mcq() -> dict[str, Any]:
        return {
            "q": sentence(rng, 60, 200) + "?",
            "options": [sentence(rng, 8, 40) for _ in LETTERS],
            "gold": rng.randrange(4),
        }

    def gen_doc() -> dict[str, Any]:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return {
            "question": f"{sentence(rng, 40, 120)} {a} and {b}, how many in total?",
            "answer": f"{sentence(rng, 20, 80)} so the total is {a + b}.\n#### {a + b}",
        }

    letters_text = '"{{q}}\\n' + "".join(f"{x}. {{{{options[{i}]}}}}\\n" for i, x in enumerate(LETTERS)) + 'Answer:"'
    tasks = {
        "fewshot_letters": (
            {
                "train": dump("letters_train", [mcq() for _ in range(5)]),
                "test": dump("letters_test", [mcq() for _ in range(n_letters)]),
            },
            "output_type: multiple_choice\nfewshot_split: train\nnum_fewshot: 5\nfewshot_config:\n  sampler: first_n\n"
            f"doc_to_text: {letters_text}\ndoc_to_choice: {json.dumps([' ' + x for x in LETTERS])}\n"
            'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n',
        ),
        "endings": (
            {
                "test": dump(
                    "endings_test",
                    [
                        {
                            "ctx": sentence(rng, 80, 240),
                            "endings": [" " + sentence(rng, 25, 80) for _ in range(4)],
                            "gold": rng.randrange(4),
                        }
                        for _ in range(n_endings)
                    ],
                )
            },
            'output_type: multiple_choice\ndoc_to_text: "{{ctx}}"\ndoc_to_choice: "{{endings}}"\n'
            'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
        ),
        "fewshot_gen": (
            {
                "train": dump("gen_train", [gen_doc() for _ in range(4)]),
                "test": dump("gen_test", [gen_doc() for _ in range(n_gen)]),
            },
            "output_type: generate_until\nfewshot_split: train\nnum_fewshot: 4\nfewshot_config:\n  sampler: first_n\n"
            'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
            'target_delimiter: " "\nfewshot_delimiter: "\\n\\n"\n'
            f'generation_kwargs:\n  until: ["Question:", "\\n\\n"]\n  max_gen_toks: {MAX_GEN_TOKS[size]}\n'
            "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
        ),
    }
    tasks["rolling"] = (
        {"test": dump("rolling_test", [{"text": sentence(rng, *ROLLING_CHARS[size])} for _ in range(n_rolling)])},
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    )
    for name, (files, body) in tasks.items():
        splits = "".join(f"    {split}: {path}\n" for split, path in files.items())
        with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(
                f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{splits}test_split: test\n{body}"
            )


class _Recorder:
    """The token sequences acb's lm-eval model sends to its engine (for the floor)."""

    def __init__(self) -> None:
        self.scored: list[tuple[list[int], list[int]]] = []  # (context, continuation)
        self.generated: list[tuple[list[int], int]] = []  # (prompt, tokens generated)
        # the engine's prefix cache over the recorded calls: tokens looked up, found, and the
        # state layers' snapshots restored (Engine.stats before and after each call)
        self.prefix = dict(prefix_queries=0, prefix_hits=0, state_snapshot_restores=0)

    def count(self, lm: Any, call: Any) -> Any:
        before = lm.engine.stats
        try:
            return call()
        finally:
            after = lm.engine.stats
            for k in self.prefix:
                self.prefix[k] += getattr(after, k) - getattr(before, k)

    def install(self) -> Any:
        from acb.integrations.lm_eval import AcbLM

        rec, ll, run = self, AcbLM._loglikelihood_tokens, AcbLM._run

        def loglikelihood_tokens(lm: Any, requests: Any, *a: Any, **kw: Any) -> Any:
            rec.scored.extend(((ctx + cont)[-(lm.max_length + 1) :][: -len(cont)], cont) for _, ctx, cont in requests)
            return rec.count(lm, lambda: ll(lm, requests, *a, **kw))

        def run_(lm: Any, prompts: Any, params: Any, desc: Any, disable: Any, keep: Any) -> Any:
            def keep2(i: int, out: Any) -> Any:
                rec.generated.append((prompts[i], len(out.generated_tokens)))
                return keep(i, out)

            return rec.count(lm, lambda: run(lm, prompts, params, desc, disable, keep2))

        # setattr: mypy refuses assigning to a method, which patching the class for a run is
        setattr(AcbLM, "_loglikelihood_tokens", loglikelihood_tokens)  # noqa: B010
        setattr(AcbLM, "_run", run_)  # noqa: B010

        def undo() -> None:
            setattr(AcbLM, "_loglikelihood_tokens", ll)  # noqa: B010
            setattr(AcbLM, "_run", run)  # noqa: B010

        return undo


def token_costs(model: Any) -> dict[str, float]:
    """A model's least arithmetic per fed token position (2 FLOP per multiply-add): every linear
    layer of its body once (its ``nn.Linear`` weights; the head is counted per scored row);
    per key a full-attention layer attends to, QK^T and PV; per position a linear-attention
    (gated delta rule) layer's recurrence, three products of its state per value head (k^T S,
    the rank-one update, q S) and its short convolution."""
    cfg = model.config
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    linear = sum(m.weight.numel() for m in body.modules() if isinstance(m, torch.nn.Linear))
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
    full = sum(t != "linear_attention" for t in types)
    state = 0
    if full < layers:  # Qwen3.5 / Qwen3-Next's gated DeltaNet layers
        vh, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * cfg.linear_num_key_heads * dk + vh * dv
        state = (layers - full) * 2 * (3 * vh * dk * dv + conv_dim * cfg.linear_conv_kernel_dim)
    return dict(
        linear_per_token=2.0 * linear,
        attention_per_key=2.0 * 2 * full * heads * hd,
        state_per_token=float(state),
        lm_head_per_row=2.0 * cfg.hidden_size * cfg.vocab_size,
    )


def floor_flops(costs: dict[str, float], rec: _Recorder) -> dict[str, float]:
    """The least arithmetic of the recorded work once each distinct prefix is computed once (2 FLOP
    per multiply-add; ``costs`` from :func:`token_costs`): every distinct token position fed (a
    trie over all fed sequences) through the linear layers, the state layers' recurrence and causal
    attention over its position's keys; the LM head on each distinct scored row and on each
    generated token."""
    root: dict[int, Any] = {}
    positions = keys = 0
    rows: set[int] = set()  # trie nodes whose logits row is needed (one row scores every target there)
    keep: list[dict[int, Any]] = []  # (the nodes stay alive: their ids are the rows' keys)

    def feed(seq: list[int]) -> list[dict[int, Any]]:
        nonlocal positions, keys
        node, path = root, []
        for depth, t in enumerate(seq):
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                positions += 1
                keys += depth + 1
            node = nxt
            path.append(node)
        return path

    for ctx, cont in rec.scored:
        path = feed(ctx + cont[:-1])  # the last continuation token is scored, never fed
        for node in path[len(ctx) - 1 :]:
            rows.add(id(node))
        keep.append(path[-1])
    gen_tokens = 0
    for prompt, n in rec.generated:
        feed(prompt)
        gen_tokens += n
        positions += max(n - 1, 0)  # generated tokens are fed (but the last), each distinct
        keys += sum(len(prompt) + i + 1 for i in range(max(n - 1, 0)))
    linear = costs["linear_per_token"] * positions
    attention = costs["attention_per_key"] * keys
    state = costs["state_per_token"] * positions
    head = costs["lm_head_per_row"] * (len(rows) + gen_tokens)
    return dict(
        total=float(linear + attention + state + head),
        linear=float(linear),
        attention=float(attention),
        state=float(state),
        lm_head=float(head),
        positions=float(positions),
    )


def run(
    size: str,
    spec: ModelSpec,
    baselines: bool = True,
    tasks: tuple[str, ...] = TASKS,
    docs: int | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """The bench (``acb bench eval``). Shorter runs: ``tasks`` (some of :data:`TASKS`); ``docs``,
    the first ``docs`` documents of each task only (``acb bench eval --docs``), without the runs on
    the first ``LIMIT`` documents and the combined calls; ``warmup=False`` (the tests)."""
    full = docs is None  # the whole bench
    if not set(tasks) <= set(TASKS):
        raise ValueError(f"unknown tasks {sorted(set(tasks) - set(TASKS))}; choose from {TASKS}")
    combined = COMBINED if full and tuple(tasks) == TASKS else {}
    import lm_eval  # type: ignore[import-untyped]
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

    import acb.integrations.lm_eval  # noqa: F401 - registers "acb"
    from acb.bench.common import bench_model, describe_config
    from acb.models import build_tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    folder = tempfile.mkdtemp(prefix="acb_bench_eval_")
    tok = build_tokenizer()
    shape: dict[str, Any] = dict(SHAPES[size], vocab_size=len(tok))
    dtype = torch.float32 if spec.device == "cpu" else torch.bfloat16
    model = bench_model(spec.arch, seed=spec.seed, dtype=dtype, **shape)
    params = sum(p.numel() for p in model.parameters())
    costs = token_costs(model) if spec.arch in EVAL_ARCHS else None  # (another family: no floor)
    sizes = shape if spec.arch == "llama" else describe_config(spec.arch, model.config)
    path = os.path.join(folder, "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    _write_tasks(folder, size)
    manager = TaskManager(include_path=folder, include_defaults=False)

    sides = {"acb": ("acb", f"pretrained={path}")}
    if baselines:
        sides["hf (batch 16)"] = ("hf", f"pretrained={path},batch_size=16")
        if spec.device != "cpu":
            # (on CPU, lm-eval's batch-size detection runs a max_length x 64 forward first: minutes)
            sides["hf (batch auto)"] = ("hf", f"pretrained={path},batch_size=auto")

    def evaluate(model_name: str, args: str, tasks: list[str], limit: int | None = None) -> tuple[dict, float]:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=model_name,
            model_args=args,
            tasks=tasks,
            task_manager=manager,
            device=spec.device,
            limit=limit,
            log_samples=True,
            verbosity="ERROR",
        )
        return out, time.perf_counter() - t0

    # lm-eval ends every evaluation with torch's collect_env (``pip list`` and other subprocesses:
    # about a second inside each timed call, the same for every side); the JSON has the machine
    # from acb's own description, so that step is skipped while the bench runs
    import lm_eval.evaluator as evaluator  # type: ignore[import-untyped]

    env_info = evaluator.__dict__.get("add_env_info")
    if env_info is not None:
        evaluator.add_env_info = lambda storage: None
    seconds: dict[str, dict[str, float]] = {label: {} for label in sides}
    limited: dict[str, dict[str, float]] = {label: {} for label in sides}  # the first LIMIT documents
    outs: dict[str, dict[str, dict]] = {label: {} for label in sides}
    limited_outs: dict[str, dict[str, dict]] = {label: {} for label in sides}
    rec = _Recorder()
    limit = LIMIT[size]
    try:
        for model_name, args in sides.values() if warmup else ():  # untimed warm-up
            evaluate(model_name, args, list(tasks), limit=2)
        undo = rec.install()
        try:
            for task in tasks:
                for label, (model_name, args) in sides.items():  # interleaved: a slow spell hits every side
                    outs[label][task], seconds[label][task] = evaluate(model_name, args, [task], limit=docs)
        finally:
            undo()  # (the floor is of the full runs)
        for task in (*tasks, *combined) if full else ():
            for label, (model_name, args) in sides.items():
                if task not in COMBINED and DOCS[size][TASKS.index(task)] <= limit:  # the full run was this run
                    limited_outs[label][task], limited[label][task] = outs[label][task], seconds[label][task]
                    continue
                names = list(COMBINED.get(task, (task,)))
                limited_outs[label][task], limited[label][task] = evaluate(model_name, args, names, limit=limit)
    finally:
        if env_info is not None:
            evaluator.add_env_info = env_info
    peak = (
        matmul_peak_gflops(spec.device)
        if size == "default"
        else matmul_peak_gflops(spec.device, seconds=0.2, min_reps=1)
    )
    floor = floor_flops(costs, rec) if costs is not None else None
    rows: list[dict[str, Any]] = []
    for label in sides:
        total = sum(seconds[label].values())
        rows.append(
            {
                "engine": label,
                "seconds": total,
                "per_task": seconds[label],
                "per_task_limited": limited[label],
                "metrics": {
                    t: {
                        k: v
                        for k, v in outs[label][t]["results"][t].items()
                        if isinstance(v, (int, float)) and "stderr" not in k
                    }
                    for t in tasks
                },
            }
        )
        if label == "acb":  # its engine's prefix cache over the full runs
            q = rec.prefix["prefix_queries"]
            rows[-1]["prefix"] = dict(rec.prefix, hit_rate=rec.prefix["prefix_hits"] / q if q else 0.0)
    doc: dict[str, Any] = {
        "workload": "eval",
        "rows": rows,
        "model": {
            "arch": f"{spec.arch} (random weights)",
            "params": params,
            "dtype": str(dtype).replace("torch.", ""),
            **sizes,
        },
        "settings": {
            "docs": {t: min(n, docs or n) for t, n in zip(TASKS, DOCS[size]) if t in tasks},
            "limit": limit if full else None,
            "docs_limit": docs,
            "held_out": "rolling",
            "max_gen_toks": MAX_GEN_TOKS[size],
            "timed": "model loading included"
            + (", after an untimed 2-document run of every task" if warmup else ", no warm-up"),
        },
        "floor": None
        if floor is None
        else {
            **floor,
            "matmul_peak_gflops": peak["gflops"],
            "threads": peak["threads"],
            "floor_s": floor["total"] / (peak["gflops"] * 1e9),
        },
    }
    if baselines:
        ref = next(r for r in rows if r["engine"] == "hf (batch 16)")
        for r in rows:
            r["hf_batch16_over_this"] = {t: ref["per_task"][t] / r["per_task"][t] for t in tasks}
            r["speedup_vs_hf_batch16"] = ref["seconds"] / r["seconds"]
            r["hf_batch16_over_this_limited"] = {
                t: ref["per_task_limited"][t] / r["per_task_limited"][t] for t in r["per_task_limited"]
            }
        doc["agreement"] = _agreement(outs["hf (batch 16)"], outs["acb"], tok, tasks)
        if combined:
            doc["agreement_limited"] = _agreement(
                limited_outs["hf (batch 16)"][TOGETHER], limited_outs["acb"][TOGETHER], tok, TASKS, together=True
            )
    return doc


def _agreement(hf: dict, acb: dict, tok: Any, tasks: tuple[str, ...], together: bool = False) -> dict[str, Any]:
    """Whether acb's numbers are hf's: the largest loglikelihood difference (absolute, and per
    scored token), and equal greedy flags, generations and metrics (a perplexity within 1e-5 of
    hf's, relative: it is the exponential of a sum of float32 loglikelihoods). ``hf`` and ``acb``
    map each task to its ``simple_evaluate`` output, or are one output of every task (``together``)."""
    worst, worst_tok, same_flags, same_text, metrics = 0.0, 0.0, True, True, True
    for task in tasks:
        out_hf, out_acb = (hf, acb) if together else (hf[task], acb[task])
        a = sorted(out_hf["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(out_acb["samples"][task], key=lambda s: s["doc_id"])
        for x, y in zip(a, b):
            for args, rx, ry in zip(x["arguments"], x["resps"], y["resps"]):
                rx, ry = rx[0], ry[0]
                if isinstance(rx, (list, tuple)):  # loglikelihood: (logprob, greedy)
                    n = max(len(tok(args[1], add_special_tokens=False)["input_ids"]), 1)
                    worst = max(worst, abs(rx[0] - ry[0]))
                    worst_tok = max(worst_tok, abs(rx[0] - ry[0]) / n)
                    same_flags &= bool(rx[1]) == bool(ry[1])
                elif isinstance(rx, float):  # loglikelihood_rolling: the document's logprob
                    n = max(len(tok(args[0], add_special_tokens=False)["input_ids"]), 1)
                    worst = max(worst, abs(rx - ry))
                    worst_tok = max(worst_tok, abs(rx - ry) / n)
                else:
                    same_text &= rx == ry
        for k, v in out_hf["results"][task].items():
            if not isinstance(v, float) or "stderr" in k or v != v:
                continue
            w = out_acb["results"][task].get(k, float("nan"))
            metrics &= bool(abs(v - w) <= (1e-5 * abs(v) if "perplexity" in k or "bits" in k else 1e-9))
    # float32 noise, not a difference of method: after 1,500-token contexts (the few-shot task) a
    # float32 forward of this model is 5e-5 to 1.5e-4 from a float64 one, per token, whichever way
    # it is batched (measured: a plain forward, an hf-style right-padded batch and acb's scoring
    # alike; acb within 2e-6 of the plain float32 forward); a continuation's loglikelihood sums
    # its tokens' (up to 80 of them in the endings task)
    return {
        "max_abs_loglikelihood_diff": worst,
        "max_diff_per_token": worst_tok,
        "greedy_flags_equal": same_flags,
        "generations_equal": same_text,
        "metrics_equal": metrics,
        "ok": worst_tok <= 2e-4 and same_flags and same_text and metrics,
    }


def markdown(doc: dict[str, Any]) -> list[str]:
    r = doc["result"]
    tasks = list(r["rows"][0]["per_task"])  # (a result written before a task was added has fewer)
    combined = [t for t in COMBINED if t in r["rows"][0]["per_task_limited"]]
    lines = [
        "| backend | " + " | ".join(f"{t} (s)" for t in tasks) + " | total (s) | speed-up vs hf batch 16 |",
        "|---|" + "---|" * (len(tasks) + 2),
    ]
    for row in r["rows"]:
        per = " | ".join(
            f"{row['per_task'][t]:.2f}"
            + (f" ({row['hf_batch16_over_this'][t]:.2f}x)" if "hf_batch16_over_this" in row else "")
            for t in tasks
        )
        sp = f"{row['speedup_vs_hf_batch16']:.2f}x" if "speedup_vs_hf_batch16" in row else ""
        lines.append(f"| {row['engine']} | {per} | {row['seconds']:.2f} | {sp} |")
    limit = r["settings"].get("limit")
    lines += (
        []
        if limit is None
        else [
            "",
            f"The first {limit} documents of each task (fewer where a task has fewer), then every task in one "
            f"`simple_evaluate` call ({TOGETHER}), and the first three (letters, endings, generation) in one "
            f"call ({THREE}; the issue's combined figure):",
            "",
            "| backend | " + " | ".join(f"{t} (s)" for t in (*tasks, *combined)) + " |",
            "|---|" + "---|" * (len(tasks) + len(combined)),
        ]
    )
    for row in r["rows"] if limit is not None else []:
        per = " | ".join(
            f"{row['per_task_limited'][t]:.2f}"
            + (f" ({row['hf_batch16_over_this_limited'][t]:.2f}x)" if "hf_batch16_over_this_limited" in row else "")
            for t in (*tasks, *combined)
        )
        lines.append(f"| {row['engine']} | {per} |")
    f = r["floor"]
    lines += (
        [
            "",
            "Floor: not modelled for this family (it counts dense linear layers, attention and the gated-"
            f"DeltaNet recurrence: {', '.join(EVAL_ARCHS)}).",
        ]
        if f is None
        else [
            "",
            f"Floor: once every shared prefix is computed once, the tasks need {f['total'] / 1e9:.1f} GFLOP "
            f"({f['positions']:,.0f} distinct token positions; {f['linear'] / 1e9:.1f} linear, "
            f"{f['attention'] / 1e9:.1f} attention, "
            + (f"{f['state'] / 1e9:.1f} linear-attention recurrence, " if f.get("state") else "")
            + f"{f['lm_head'] / 1e9:.1f} LM head); at this run's float32 "
            f"matmul peak of {f['matmul_peak_gflops']:.0f} GFLOP/s ({f['threads']} threads) that is "
            f"{f['floor_s']:.2f} s.",
        ]
    )
    prefix = next((row["prefix"] for row in r["rows"] if "prefix" in row), None)
    if prefix is not None:
        lines += [
            "",
            f"acb's prefix cache over the full runs: {prefix['prefix_hits']:,} of {prefix['prefix_queries']:,} "
            f"prompt tokens found cached ({prefix['hit_rate']:.1%}); state snapshots restored: "
            f"{prefix['state_snapshot_restores']:,}.",
        ]
    if "agreement" in r:
        a = r["agreement"]
        lines += [
            "",
            f"Numbers agree with hf (batch 16): {'yes' if a['ok'] else 'NO'} (largest loglikelihood "
            f"difference {a['max_abs_loglikelihood_diff']:.1e}, at most {a['max_diff_per_token']:.1e} per "
            f"continuation token; greedy flags, generations and metrics "
            f"{'equal' if a['greedy_flags_equal'] and a['generations_equal'] and a['metrics_equal'] else 'differ'})"
            + (
                f"; in the one call on {limit} documents each: {'yes' if r['agreement_limited']['ok'] else 'NO'}."
                if "agreement_limited" in r
                else "."
            ),
        ]
    return lines
