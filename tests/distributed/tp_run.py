"""Run by the tests under ``torchrun --nproc-per-node 2``: acb engines on a tensor-parallel model.

    torchrun --nproc-per-node 2 tests/distributed/tp_run.py OUT_DIR MODELS_DIR

Every rank writes ``OUT_DIR/{parity,mismatch,die}_rank<r>.json`` (``die`` last: it breaks the group); the tests compare rank 0's outputs with a
single-process ``model.generate`` and check that the ranks ran the same steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import acb
from acb.models import build_tokenizer

CONSTRAINED_REGEX = r"[a-c]{2,5}![0-9]"
SHARED = [7, 19, 33, 41, 58, 60, 77, 81, 90, 102, 111, 120]  # a 12-token prefix several prompts share


SCORE_ITEMS = [(SHARED + [5, 9], [[3], [4], [30, 31, 32]]), ([8, 9, 10, 11, 12], [[13, 14], [15]])]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [SHARED + torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 5)]
    out += [torch.randint(3, 250, (n,), generator=g).tolist() for n in (4, 23, 11, 30, 2, 17)]
    return out


def load(models: str, arch: str):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(
        os.path.join(models, arch), dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()


def engine_facts(eng) -> dict:
    st = eng.stats
    sync = eng.core.sync  # type: ignore[union-attr]
    return {
        "steps": st.steps,
        "preemptions": st.preemptions,
        "prefix_hits": st.prefix_hits,
        "finished": st.finished,
        "cancelled": st.cancelled,
        "num_blocks": eng.config.num_blocks,
        "broadcasts": sync.broadcasts,
        "follower": eng.is_follower,
    }


def parity(models: str, rank: int) -> dict:
    result: dict = {}
    for arch, async_batching in (("llama", True), ("qwen3", False)):
        model = load(models, arch)
        # 12 usable blocks of 4 tokens, 16 tokens a step: chunked prefill, preemption, prefix hits
        cfg = acb.ContinuousBatchingConfig(
            page_size=4, num_blocks=13, max_batch_tokens=16, safety_margin=0.0, use_async_batching=async_batching
        )
        # every rank has the tokenizer: stop strings and grammars are matched on every rank
        with acb.Engine(model, cfg, tokenizer=build_tokenizer()) as eng:
            kv_heads = eng.runner.kv_cache.spec.num_kv_heads
            t0 = time.perf_counter()
            outs = eng.generate_batch(prompts(), max_new_tokens=10, ignore_eos=True, progress_bar=False)
            wall = time.perf_counter() - t0
            # a second round: the shared prefix is cached now; then a reset of the prefix cache
            again = eng.generate_batch(prompts()[:3], max_new_tokens=4, ignore_eos=True, progress_bar=False)
            # scoring requests: the continuations of two contexts (one sharing the cached prefix)
            scores = eng.score_batch(SCORE_ITEMS, top_logprobs=1, progress_bar=False)
            # (one broadcast per loop iteration: counted before the constrained round, whose
            # requests skip the async steps their mask waits for, in iterations that launch none)
            before = {"steps": eng.stats.steps, "broadcasts": eng.core.sync.broadcasts}  # type: ignore[union-attr]
            # structured outputs: each rank compiles the grammar and masks its own logits shard's
            # samples alike (sampled, two samples each)
            constrained = eng.generate_batch(
                prompts()[:4],
                max_new_tokens=16,
                temperature=1.0,
                seed=7,
                n=2,
                structured_outputs={"regex": CONSTRAINED_REGEX},
                progress_bar=False,
            )
            if not eng.is_follower:
                eng.reset_prefix_cache()
        facts = engine_facts(eng)  # once stopped: a follower's engine ran until the leader's stopped
        facts["kv_heads"] = kv_heads
        result[arch] = {
            "outputs": [o.generated_tokens for o in outs.values()],
            "again": [o.generated_tokens for o in again.values()],
            "scores": [[[c.logprobs, c.greedy] for c in o.continuations] for o in scores],
            "constrained": [[s.text for s in o.samples] for o in constrained.values()],
            "before_constrained": before,
            "facts": facts,
            "wall_s": wall,
        }
    # an AsyncEngine on rank 0 (what acb serve runs): streaming and a cancellation; rank 1 follows
    model = load(models, "llama")
    cfg = acb.ContinuousBatchingConfig(page_size=4, num_blocks=64)
    if rank == 0:

        async def serve() -> dict:
            async with acb.AsyncEngine(model, cfg) as eng:
                streamed = await eng.submit(prompts()[3], max_new_tokens=12, ignore_eos=True)
                doomed = await eng.submit(prompts()[4], max_new_tokens=500, ignore_eos=True)
                deltas = []
                async for d in streamed:
                    deltas.append(d.token_ids)
                async for _d in doomed:
                    doomed.cancel()
                    break
                cancelled = await doomed.result()
            facts = engine_facts(eng)
            return {
                "deltas": deltas,
                "final": (await streamed.result()).generated_tokens,
                "cancelled": cancelled.finish_reason.value,
                "cancelled_tokens": len(cancelled.generated_tokens),
                "facts": facts,
            }

        result["async"] = asyncio.run(serve())
    else:
        with acb.Engine(model, cfg) as eng:  # follows rank 0's engine until it stops
            try:
                eng.submit([1, 2, 3])
            except RuntimeError as exc:
                result["submit_refused"] = str(exc)
            assert eng.generate_batch([[1, 2, 3]]) == {}
        result["async"] = {"facts": engine_facts(eng)}
    return result


def mismatch(models: str, rank: int) -> dict:
    """Rank 1 starts its engine with other settings than rank 0's: both refuse at start, naming
    the settings; then engines started alike on the same group run as usual."""
    model = load(models, "llama")
    mine = (
        {"max_batch_tokens": 16, "max_requests_per_batch": 4, "use_async_batching": False}
        if rank == 0
        else {"max_batch_tokens": 8, "max_requests_per_batch": 2, "use_async_batching": True}
    )
    t0 = time.perf_counter()
    try:
        with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=4, num_blocks=64, **mine)) as eng:
            # (unrefused, the ranks' steps differ here: gloo aborts a process, SIGABRT)
            eng.generate_batch(prompts(), max_new_tokens=6, ignore_eos=True, progress_bar=False)
            error = None
    except ValueError as exc:
        error = str(exc)
    result: dict = {"error": error, "seconds": time.perf_counter() - t0}
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=4, num_blocks=64)) as eng:
        outs = eng.generate_batch(prompts()[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)
    result["after"] = [o.generated_tokens for o in outs.values()]
    return result


def die(models: str, rank: int) -> dict:
    """Rank 1's step fails mid-generation: every handle on rank 0 fails instead of hanging."""
    model = load(models, "llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=4, num_blocks=64)) as eng:
        if rank == 1:
            runner, real = eng.runner, eng.runner.execute
            calls = [0]

            def failing(sched):
                calls[0] += 1
                if calls[0] == 5:
                    raise RuntimeError("injected failure on rank 1")
                return real(sched)

            runner.execute = failing
            eng.join()  # its engine dies at its 5th step
            return {"dead": repr(eng.core.dead_error)}
        t0 = time.perf_counter()
        hs = [eng.submit(p, max_new_tokens=200, ignore_eos=True) for p in prompts()[:4]]
        errors = []
        for h in hs:
            try:
                h.result(timeout=120)
                errors.append(None)
            except acb.AcbError as exc:
                errors.append(type(exc).__name__)
        return {"errors": errors, "seconds": time.perf_counter() - t0, "dead": repr(eng.core.dead_error)}


def main() -> None:
    out, models = sys.argv[1], sys.argv[2]
    # the collectives' timeout: a rank that stops taking part is noticed in seconds, not hours
    timeout = float(os.environ.get("ACB_TP_TIMEOUT_S", "20"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    for scenario in (parity, mismatch, die):
        result = scenario(models, rank)
        with open(os.path.join(out, f"{scenario.__name__}_rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
