"""The batch-invariant mode (``batch_invariant=True``): how far a request's logprobs move with its
batch without it, how far the sampler's are from the trainer's, and what the mode costs, in one run.

    python benchmarks/batch_invariance.py [--out benchmarks/results/batch_invariance_cpu.json]

Model: a random float32 Llama (hidden 512, 4 layers, 8 heads / 4 KV heads, intermediate 1536,
vocabulary 8192: 21M parameters). Each side (``plain``: the default engine; ``mode``:
``batch_invariant=True``) measures:

1. **Batch dependence.** One request (a 37-token prompt, 24 sampled tokens, temperature 0.9,
   seeded, ``logprobs_mode="processed"``) alone at 2 threads, against the same request: in a batch
   of 64 of other lengths (5-200 tokens), chunked (``max_batch_tokens=16``), after a prefix hit,
   alone at 1 thread, in the batch at 1 thread. Max |Δ logprob| over its tokens (the tokens are
   the same in every case here; a case whose tokens differ is reported as such).
2. **Sampler against trainer.** A GRPO batch (8 prompts x 4 samples, 24 tokens, temperature 0.9)
   sampled with logprobs; the trainer recomputes each completion's logprobs as TRL does
   (``model(prompt + completion)`` in float32, ``log_softmax(logits / T)`` at the completion's
   tokens; ``plain``: transformers' SDPA attention and torch's linears; ``mode``: under
   ``acb.runner.batch_invariant.enabled(model)``), one padded forward per group of 4. Max and
   mean |Δ| over the batch's tokens.
3. **Throughput.** 64 prompts (16-200 tokens) x 64 new tokens, greedy, ``generate_batch``;
   tok/s (generated tokens over wall time), the sides alternating, best of ``--rounds``, with a
   third, ``mode_vector_tails``: the mode without its whole-forward scalar path for element-wise
   transcendentals (what that path costs; ``--throughput-only`` reruns just this part). Then
   long prompts, where the mode's per-query prefill attention weighs: 16 prompts of 512-900
   tokens x 16 new tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import machine_info, write_json  # noqa: E402
from acb.models import tiny_model  # noqa: E402
from acb.runner import batch_invariant as bi  # noqa: E402
from acb.runner import batch_invariant_families as fam  # noqa: E402

TEMP = 0.9
NEW = 24


def make_model() -> torch.nn.Module:
    return tiny_model(
        "llama",
        seed=0,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
        max_position_embeddings=1024,
    )


def sampling(seed: int) -> acb.SamplingParams:
    return acb.SamplingParams(
        max_new_tokens=NEW,
        ignore_eos=True,
        do_sample=True,
        temperature=TEMP,
        top_k=0,
        top_p=1.0,
        seed=seed,
        logprobs=0,
        logprobs_mode="processed",
    )


def run(model: Any, mode: bool, prompts: list[list[int]], seeds: list[int], threads: int = 2, **cfg: Any) -> list[Any]:
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    cfg.setdefault("num_blocks", 1024)
    config = acb.ContinuousBatchingConfig(page_size=16, batch_invariant=mode, cpu_threads=threads, **cfg)
    try:
        with acb.Engine(model, config) as eng:
            eng.pause()
            hs = [eng.submit(p, sampling(s)) for p, s in zip(prompts, seeds)]
            eng.resume()
            return [h.result() for h in hs]
    finally:
        torch.set_num_threads(was)


def delta(a: Any, b: Any) -> float | str:
    if a.generated_tokens != b.generated_tokens:
        return "tokens differ"
    return float(
        (torch.tensor(a.logprobs, dtype=torch.float64) - torch.tensor(b.logprobs, dtype=torch.float64)).abs().max()
    )


def batch_dependence(model: Any, mode: bool, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    target = [rng.randrange(3, vocab) for _ in range(37)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 200))] for _ in range(63)]
    seeds = [7] + list(range(100, 163))
    alone = run(model, mode, [target], [7])[0]
    out: dict[str, Any] = {}
    out["in a batch of 64"] = delta(run(model, mode, [target, *others], seeds)[0], alone)
    out["chunked (16-token steps)"] = delta(
        run(model, mode, [target, *others[:7]], seeds[:8], max_batch_tokens=16)[0], alone
    )
    out["alone at 1 thread"] = delta(run(model, mode, [target], [7], threads=1)[0], alone)
    out["in a batch of 64 at 1 thread"] = delta(run(model, mode, [target, *others], seeds, threads=1)[0], alone)
    torch.set_num_threads(2)
    with acb.Engine(
        model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=1024, batch_invariant=mode, cpu_threads=2)
    ) as eng:
        eng.generate(target[:32] + [5, 6, 7], acb.SamplingParams(max_new_tokens=1))
        out["after a prefix hit (32 tokens)"] = delta(eng.submit(target, sampling(7)).result(), alone)
    return out


def trainer_logprobs(model: Any, mode: bool, prompt: list[int], completions: list[list[int]]) -> list[torch.Tensor]:
    """One padded forward for a group (the prompt and its completions, right-padded), as a trainer
    does; each completion's logprobs."""
    seqs = [prompt + c for c in completions]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        if mode:
            with bi.enabled(model):
                logits = model(input_ids=ids, attention_mask=mask).logits
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for row, c in enumerate(completions):
        lg = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(c)]
        if mode:
            out.append(bi.token_logprobs(lg, c, TEMP).double())
        else:
            out.append((lg.float() / TEMP).log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0].double())
    return out


def sampler_vs_trainer(model: Any, mode: bool, vocab: int) -> dict[str, Any]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 64))] for _ in range(8)]
    group = [p for p in prompts for _ in range(4)]
    outs = run(model, mode, group, list(range(len(group))))
    deltas = []
    for i, p in enumerate(prompts):
        samples = outs[4 * i : 4 * i + 4]
        got = trainer_logprobs(model, mode, p, [o.generated_tokens for o in samples])
        for o, t in zip(samples, got):
            deltas.append((t - torch.tensor(o.logprobs, dtype=torch.float64)).abs())
    d = torch.cat(deltas)
    return {"tokens": int(d.numel()), "max": float(d.max()), "mean": float(d.mean()), "exact": bool((d == 0).all())}


def throughput(
    model: Any, rounds: int, vocab: int, lengths: tuple[int, int] = (16, 200), n: int = 64, new: int = 64
) -> dict[str, Any]:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))] for _ in range(n)]
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    engines = {
        name: acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=1024, page_size=16, batch_invariant=mode))
        for name, mode in (("plain", False), ("mode", True), ("mode_vector_tails", True))
    }
    try:
        for eng in engines.values():
            eng.start()
            eng.generate_batch(prompts[:4], max_new_tokens=4, ignore_eos=True, temperature=0.0, progress_bar=False)
        for _ in range(rounds):
            for name, eng in engines.items():
                fam.WHOLE_FORWARD = name != "mode_vector_tails"
                t0 = time.perf_counter()
                outs = eng.generate_batch(
                    prompts, max_new_tokens=64, ignore_eos=True, temperature=0.0, progress_bar=False
                )
                dt = time.perf_counter() - t0
                tokens[name] = [o.generated_tokens for o in outs.values()]
                best[name] = max(best.get(name, 0.0), 64 * len(prompts) / dt)
    finally:
        fam.WHOLE_FORWARD = True
        for eng in engines.values():
            eng.shutdown()
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["mode"]))
    return {
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "mode_over_plain": round(best["mode"] / best["plain"], 3),
        # the whole forward's element-wise transcendentals on the scalar path, against the mode without it
        "mode_over_mode_vector_tails": round(best["mode"] / best["mode_vector_tails"], 3),
        "greedy_rows_equal_across_sides": f"{same}/{len(prompts)}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/batch_invariance_cpu.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--throughput-only", action="store_true", help="rerun the throughput parts into --out's file")
    a = ap.parse_args()
    model = make_model()
    vocab = model.config.vocab_size
    if a.throughput_only:
        import json

        res = json.loads(Path(a.out).read_text())
        res["throughput_only"] = (
            "the throughput parts rerun alone (--throughput-only); the other parts from an earlier full run"
        )
        res["throughput_64x64_greedy"] = throughput(model, a.rounds, vocab)
        print(res["throughput_64x64_greedy"], flush=True)
        res["throughput_16x(512-900)_prompts_x16_greedy"] = throughput(model, a.rounds, vocab, (512, 900), 16, 16)
        print(res["throughput_16x(512-900)_prompts_x16_greedy"], flush=True)
        write_json(a.out, res)
        return
    res: dict[str, Any] = {"machine": machine_info(), "model": "llama hidden 512, 4 layers, vocab 8192, float32"}
    for name, mode in (("plain", False), ("mode", True)):
        res[name] = {
            "batch_dependence_max_abs_dlogprob": batch_dependence(model, mode, vocab),
            "sampler_vs_trainer_grpo_batch": sampler_vs_trainer(model, mode, vocab),
        }
        print(name, res[name], flush=True)
    res["throughput_64x64_greedy"] = throughput(model, a.rounds, vocab)
    print(res["throughput_64x64_greedy"], flush=True)
    # long prompts: the kernel computes each prefill query alone (SDPA's blocked products otherwise)
    res["throughput_16x(512-900)_prompts_x16_greedy"] = throughput(model, a.rounds, vocab, (512, 900), 16, 16)
    print(res["throughput_16x(512-900)_prompts_x16_greedy"], flush=True)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
