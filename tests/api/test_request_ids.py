"""Default request ids are unique per call, whoever else uses the engine at the same time: a
default id never collides with another call's (concurrent ``score``, ``generate_batch`` from two
threads), with an id a caller chose, or with the internal ids of another request's ``n > 1``
samples or scoring children. Two calls that each take default ids both run."""

from __future__ import annotations

import asyncio
import threading

import acb
from tests.api.test_scoring import check
from tests.conftest import get_model, prompts_of_lengths, reference_generate

CFG = dict(page_size=8, num_blocks=64)


def _gated(eng) -> threading.Event:
    """Hold the engine thread between steps until the event is set, so that every call below is
    live at once (no timing: the calls are made while the engine cannot finish any of them)."""
    gate = threading.Event()
    eng.core.call(lambda c: gate.wait(60))
    return gate


async def test_concurrent_async_scores_have_their_own_ids():
    model = get_model("llama")
    ctxs = prompts_of_lengths([9, 14, 20, 6], seed=90)
    conts = [[3], [4, 5], [6, 7, 8]]
    cfg = acb.ContinuousBatchingConfig(**CFG, use_async_batching=True)
    async with acb.AsyncEngine(model, cfg) as eng:
        outs = await asyncio.gather(*(eng.score(c, conts) for c in ctxs))
        assert len({o.request_id for o in outs}) == 4
        # and with the four calls live at once, and a caller's own id among them
        gate = _gated(eng)
        tasks = [
            asyncio.ensure_future(eng.score(c, conts, request_id="mine" if i == 2 else None))
            for i, c in enumerate(ctxs)
        ]
        await asyncio.sleep(0)  # a yield, not a wait: each task runs until it awaits its results
        gate.set()
        outs2 = await asyncio.gather(*tasks)
    for ctx, out, out2 in zip(ctxs, outs, outs2):
        check(model, out, ctx, conts)
        check(model, out2, ctx, conts)
    assert outs2[2].request_id == "mine"


def test_scores_and_batches_from_two_threads():
    model = get_model("llama")
    ctxs = prompts_of_lengths([11, 17], seed=91)
    prompts = prompts_of_lengths([4, 7, 5], seed=92)
    refs = [reference_generate(model, p, 4) for p in prompts]
    conts = [[3], [4, 5, 6]]
    scores: dict[int, acb.ScoreOutput] = {}
    batches: dict[int, dict[str, acb.GenerationOutput]] = {}
    errors: list[BaseException] = []
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        gate = _gated(eng)
        started = threading.Barrier(4 + 1)

        def run(fn) -> None:
            try:
                started.wait(60)
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(lambda i=i: scores.__setitem__(i, eng.score(ctxs[i], conts)),))
            for i in range(2)
        ]
        threads += [
            threading.Thread(
                target=run,
                args=(
                    lambda i=i: batches.__setitem__(
                        i, eng.generate_batch(prompts, max_new_tokens=4, ignore_eos=True, progress_bar=False)
                    ),
                ),
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        started.wait(60)
        gate.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    for i in range(2):
        check(model, scores[i], ctxs[i], conts)
        assert list(batches[i]) == ["req_0", "req_1", "req_2"]
        assert [o.generated_tokens for o in batches[i].values()] == refs
        assert [o.request_id for o in batches[i].values()] == ["req_0", "req_1", "req_2"]


def test_a_default_id_skips_a_live_sample_id():
    """A caller's id that names another default's sample (``req_<n>#1``) does not make an ``n=2``
    submit with a default id fail: the default moves on to an id whose samples are free too."""
    model = get_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        gate = _gated(eng)  # the held requests stay live while the n=2 submit picks its id
        held = [eng.submit([5, 6], max_new_tokens=2, ignore_eos=True, request_id=f"req_{k}#1") for k in range(3)]
        also = eng.submit([5, 6], max_new_tokens=2, ignore_eos=True, request_id="req_3")
        h = eng.submit([5, 6, 7], max_new_tokens=2, ignore_eos=True, n=2)
        gate.set()
        out = h.result(60)
        assert out.status == acb.RequestStatus.FINISHED and len(out.samples) == 2
        assert h.request_id not in {"req_0", "req_1", "req_2", "req_3"}
        for other in held + [also]:
            assert other.result(60).status == acb.RequestStatus.FINISHED


def test_manager_default_ids_skip_a_callers_own():
    model = get_model("llama")
    manager = acb.init_continuous_batching(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    manager.start()
    try:
        mine = manager.add_request([5, 6, 7], request_id="req_1", max_new_tokens=3)
        ids = [manager.add_request([5, 6], max_new_tokens=3) for _ in range(3)]
        assert mine == "req_1" and len(set(ids) | {mine}) == 4
        got = set()
        while len(got) < 4:
            out = manager.get_result(timeout=60)
            assert out is not None and out.status == acb.RequestStatus.FINISHED
            got.add(out.request_id)
        assert got == set(ids) | {mine}
    finally:
        manager.stop(block=True)
