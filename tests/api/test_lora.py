"""LoRA adapters through the engine's public API (issue 56): ``add_lora``/``remove_lora``/
``list_loras``, ``submit(..., lora=)`` on every facade, and exactness: every row of a batch that
mixes two adapters and the base model gives the greedy tokens of ``PeftModel.generate`` with that
adapter active (the base rows: the base model's), in every mode the engine runs (chunked prefill,
preemption with offload, async batching, ``n > 1``, scoring). The adapters are random PEFT
adapters saved with ``save_pretrained`` to a tmp folder and read back by the engine, as a user's."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch

import acb
from acb.core.messages import Add, EngineRequest
from acb.core.wire import from_wire, to_wire
from acb.errors import InvalidRequestError
from acb.models import tiny_model
from acb.sampling_params import SamplingParams
from tests.conftest import prompts_of_lengths, wait_until

peft = pytest.importorskip("peft")

MAX_NEW = 8
PROMPTS = prompts_of_lengths([13, 22, 9, 30, 17, 11], seed=56)
CHOICE = ["a", "b", None, "b", None, "a"]  # each prompt's adapter: two adapters and the base, mixed


def _randomise(model, adapter: str, seed: int) -> None:
    """PEFT starts B at zero (the adapter changes nothing): random A and B, large enough that the
    adapter changes the greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if f".{adapter}." in name and "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The base model (the engine's), a PeftModel over a copy of it with adapters ``a`` (r=8, on
    attention and the MLP) and ``b`` (r=4, rsLoRA, attention only), and each saved to a folder."""
    base = tiny_model("llama", seed=3)
    ref = peft.get_peft_model(
        tiny_model("llama", seed=3),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
        adapter_name="peft_a",
    )
    ref.add_adapter("peft_b", peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "v_proj"]))
    _randomise(ref, "peft_a", 1)
    _randomise(ref, "peft_b", 2)
    root = tmp_path_factory.mktemp("loras")
    folders = {}
    for name in ("a", "b"):
        ref.save_pretrained(root / name, selected_adapters=[f"peft_{name}"])
        found = [p.parent for p in (root / name).rglob("adapter_config.json")]
        assert len(found) == 1, found
        folders[name] = found[0]
    ref.eval()
    return base, ref, folders


def _peft_generate(ref, prompt: list[int], adapter: str | None, max_new: int = MAX_NEW) -> list[int]:
    """Greedy tokens of ``PeftModel.generate`` with ``adapter`` active (None: adapters disabled)."""
    kw = dict(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                out = ref.generate(**kw)
        else:
            ref.set_adapter(f"peft_{adapter}")
            out = ref.generate(**kw)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(adapters):
    _, ref, _ = adapters
    want = [_peft_generate(ref, p, c) for p, c in zip(PROMPTS, CHOICE)]
    # the test can fail: each adapter changes the greedy tokens of the base model
    for i, (p, c) in enumerate(zip(PROMPTS, CHOICE)):
        if c is not None:
            assert want[i] != _peft_generate(ref, p, None), f"adapter {c} leaves prompt {i}'s tokens as they were"
    return want


def _engine(adapters, **kw) -> acb.Engine:
    base, _, folders = adapters
    cfg = acb.ContinuousBatchingConfig(max_loras=2, max_lora_rank=8, **{"page_size": 4, "num_blocks": 96, **kw})
    eng = acb.Engine(base, cfg)
    eng.start()
    for name, folder in folders.items():
        eng.add_lora(name, folder)
    return eng


MODES = {
    "plain": {},
    "chunked": {"max_batch_tokens": 8},  # every prompt is prefilled over several steps
    # 16 usable blocks of 4 tokens for 6 requests of up to 38 tokens: preemption, offloaded
    "preempt_offload": {
        "num_blocks": 17,
        "safety_margin": 0.0,
        "allow_block_sharing": False,
        "cpu_offload_space": 0.01,
    },
    "async": {"use_async_batching": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_mixed_batch_equals_peft_generate_for_every_row(adapters, expected, mode):
    eng = _engine(adapters, **MODES[mode])
    try:
        out = eng.generate_batch(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True, lora=CHOICE, progress_bar=False)
        got = [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
        assert got == expected
        if mode == "preempt_offload":
            assert eng.stats.preemptions > 0 and eng.stats.swapped_out_blocks > 0
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def engine(adapters):
    """One engine with both adapters, for the tests that need no special mode."""
    eng = _engine(adapters)
    yield eng
    eng.shutdown()


def test_n_samples_and_submit_take_the_adapter(engine, expected):
    # n > 1: every greedy sample is the adapter's
    h = engine.submit(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True, n=3, lora="a")
    assert [s.generated_tokens for s in h.result(timeout=120).samples] == [expected[0]] * 3
    assert (
        engine.generate(PROMPTS[1], max_new_tokens=MAX_NEW, ignore_eos=True, lora="b").generated_tokens == expected[1]
    )


@pytest.mark.anyio
async def test_the_async_engine_takes_the_adapter(adapters, expected, anyio_backend):
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough here")
    base, _, folders = adapters
    cfg = acb.ContinuousBatchingConfig(max_loras=1, max_lora_rank=8, page_size=4, num_blocks=64)
    async with acb.AsyncEngine(base, cfg) as eng:
        info = await eng.add_lora("a", folders["a"])
        assert info.slot == 1 and info.rank == 8 and [i.name for i in eng.list_loras()] == ["a"]
        h = await eng.submit(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True, lora="a")
        assert (await h.result()).generated_tokens == expected[0]
        h = eng.submit_nowait(PROMPTS[2], max_new_tokens=MAX_NEW, ignore_eos=True)
        assert (await h.result()).generated_tokens == expected[2]
        await eng.remove_lora("a")
        assert eng.list_loras() == []


def test_scoring_with_an_adapter_is_the_peft_forward(engine, adapters):
    _, ref, _ = adapters
    context, conts = PROMPTS[2], [[5, 9, 14], [7], [40, 41]]
    for adapter in ("a", "b", None):
        (scored,) = engine.score_batch([(context, conts)], lora=adapter, progress_bar=False)
        for cont, got in zip(conts, scored.continuations):
            with torch.no_grad():
                if adapter is None:
                    with ref.disable_adapter():
                        logits = ref(torch.tensor([context + cont])).logits[0].float()
                else:
                    ref.set_adapter(f"peft_{adapter}")
                    logits = ref(torch.tensor([context + cont])).logits[0].float()
            want = torch.log_softmax(logits, -1)[len(context) - 1 : -1].gather(1, torch.tensor(cont)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(got.logprobs), want, atol=1e-4), (adapter, got.logprobs, want)


def test_no_prefix_block_is_shared_across_adapters(engine):
    prompt = prompts_of_lengths([33], seed=7)[0]  # 8 full blocks of 4

    def cached(lora):
        return engine.generate(prompt, max_new_tokens=1, lora=lora).num_cached_tokens

    engine.reset_prefix_cache()
    assert cached("a") == 0
    assert cached("b") == 0  # the same prompt on another adapter: no hit
    assert cached(None) == 0  # nor on the base model
    assert cached("a") == 32  # the same adapter: its blocks are found
    assert cached(None) == 32


def test_a_first_prompt_that_is_exactly_the_shared_prefix(engine, adapters):
    """The first prompt is the shared prefix itself (8 whole blocks of 4) with an adapter; a longer
    prompt over it hits those blocks on the same adapter only (none across adapters, nor with the
    base model), and every answer is PeftModel.generate's."""
    _, ref, _ = adapters
    prefix = prompts_of_lengths([32], seed=8)[0]
    longer = prefix + [3, 14, 15, 92, 65]

    def run(prompt, lora):
        out = engine.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, lora=lora)
        assert out.generated_tokens == _peft_generate(ref, prompt, lora), (len(prompt), lora)
        return out.num_cached_tokens

    engine.reset_prefix_cache()
    assert run(prefix, "a") == 0
    assert run(longer, "b") == 0  # another adapter: no block of a's
    assert run(longer, None) == 0  # nor the base model
    assert run(longer, "a") == 32  # the same adapter: the whole prefix
    assert run(prefix, "a") == 28  # the prefix again: its blocks but the last (its last token is recomputed)


def test_unknown_name_and_the_limits_are_clear_errors(engine, adapters):
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'zz'") as e:
        engine.submit(PROMPTS[0], max_new_tokens=2, lora="zz")
    assert e.value.field == "lora"
    with pytest.raises(ValueError, match=r"inputs\[1\].*no LoRA adapter named 'zz'"):
        engine.generate_batch(PROMPTS[:2], max_new_tokens=2, lora=["a", "zz"], progress_bar=False)
    with pytest.raises(TypeError, match="lora must be"):
        engine.submit(PROMPTS[0], max_new_tokens=2, lora=3)
    _, _, folders = adapters
    with pytest.raises(InvalidRequestError, match="already loaded") as e:
        engine.add_lora("a", folders["a"])
    with pytest.raises(InvalidRequestError, match="all 2 LoRA slots are taken.*max_loras") as e:
        engine.add_lora("c", folders["a"])
    assert e.value.field == "lora"
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'c'"):
        engine.remove_lora("c")
    assert [(i.name, i.slot) for i in engine.list_loras()] == [("a", 1), ("b", 2)]


def test_lora_off_names_the_setting(adapters):
    base, _, folders = adapters
    with acb.Engine(base, acb.ContinuousBatchingConfig(num_blocks=32)) as eng:
        with pytest.raises(InvalidRequestError, match=r"max_loras=0"):
            eng.add_lora("a", folders["a"])
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'a'"):
            eng.submit([5, 6, 7], max_new_tokens=2, lora="a")


def test_an_adapter_in_use_is_not_removed_and_its_slot_is_reused(adapters, expected):
    base, _, folders = adapters
    cfg = acb.ContinuousBatchingConfig(max_loras=1, max_lora_rank=8, page_size=4, num_blocks=64)
    with acb.Engine(base, cfg) as eng:
        eng.add_lora("a", folders["a"])
        eng.pause("keep")  # the request waits in the engine: live, not finished
        h = eng.submit(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True, lora="a")
        with pytest.raises(InvalidRequestError, match=r"'a' is in use by 1 live request") as e:
            eng.remove_lora("a")
        assert e.value.field == "lora"
        eng.resume()
        assert h.result(timeout=120).generated_tokens == expected[0]
        wait_until(lambda: not eng.ids.live, "the request's ids are released")
        eng.remove_lora("a")
        # the freed slot takes another adapter, and a request on it runs that adapter
        assert eng.add_lora("b", folders["b"]).slot == 1
        assert (
            eng.generate(PROMPTS[1], max_new_tokens=MAX_NEW, ignore_eos=True, lora="b").generated_tokens == expected[1]
        )
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'a'"):
            eng.submit(PROMPTS[0], max_new_tokens=2, lora="a")


def test_the_manager_takes_the_adapter(adapters, expected):
    base, _, folders = adapters
    cfg = acb.ContinuousBatchingConfig(max_loras=1, max_lora_rank=8, page_size=4, num_blocks=64)
    mgr = acb.ContinuousBatchingManager(base, None, cfg)
    mgr.start()
    try:
        mgr.engine.add_lora("b", folders["b"])
        rid = mgr.add_request(PROMPTS[3], max_new_tokens=MAX_NEW, eos_token_id=[], lora="b")
        assert mgr.get_result(rid, timeout=120).generated_tokens == expected[3]
    finally:
        mgr.stop(block=True)


def test_the_slot_crosses_to_tensor_parallel_followers():
    er = EngineRequest("r", 3, (1, 2), SamplingParams(), 4, frozenset(), 7, cache_salt="s", lora_slot=2)
    copy = from_wire(to_wire(Add(er)))
    assert isinstance(copy, Add)
    assert dataclasses.replace(copy.req, sink_key=3, created_time=er.created_time) == er


def test_update_lora_in_place_waits_for_requests_in_flight(adapters):
    """``update_lora`` replaces an adapter's weights in its slot, versioned: a request not started
    yet runs the new weights, one started keeps the old (the swap waits for it, and gives up at its
    timeout with nothing changed); tensors that do not fit are refused whole. Exact against
    ``PeftModel.generate`` with the new adapter."""
    from acb.errors import WeightUpdateError

    base, ref, folders = adapters
    config_a = ref.peft_config["peft_a"]
    news = []
    for seed in (11, 12):
        new = peft.get_peft_model(tiny_model("llama", seed=3), copy.deepcopy(config_a), adapter_name="peft_a")
        _randomise(new, "peft_a", seed)
        news.append((new.eval(), peft.get_peft_model_state_dict(new, adapter_name="peft_a")))
    prompt = PROMPTS[1]
    old_want = _peft_generate(ref, prompt, "a")
    want = [_peft_generate(new, prompt, "a") for new, _ in news]
    assert len({tuple(old_want), *map(tuple, want)}) == 3  # (each adapter gives other tokens: the test can fail)
    cfg = acb.ContinuousBatchingConfig(max_loras=1, max_lora_rank=8, page_size=4, num_blocks=256)
    with acb.Engine(base, cfg) as eng:
        uid = eng.add_lora("a", folders["a"]).uid
        # refused whole, nothing changed: a wrong shape, a module the adapter lacks, an unknown adapter
        state = dict(news[0][1])
        key = next(iter(state))
        bad = {**state, key: torch.zeros(state[key].shape[0] + 1, state[key].shape[1])}
        with pytest.raises(WeightUpdateError, match="shape"):
            eng.update_lora("a", bad)
        with pytest.raises(WeightUpdateError, match="not one of adapter 'a'"):
            eng.update_lora("a", {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)})
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'zz'"):
            eng.update_lora("zz", state)
        assert [i.uid for i in eng.list_loras()] == [uid]
        # a request submitted but not started runs the new weights, under the new version
        eng.pause("keep")
        h = eng.submit(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, lora="a")
        assert eng.update_lora("a", state, version=5) == 5
        eng.resume()
        out = h.result(timeout=120)
        assert out.generated_tokens == want[0] and out.weight_version == 5
        assert eng.list_loras()[0].uid != uid and eng.list_loras()[0].slot == 1
        # a started request keeps the weights it started with: the swap waits for it
        long = eng.generate(PROMPTS[3], max_new_tokens=120, ignore_eos=True, lora="a").generated_tokens
        h = eng.submit(PROMPTS[3], max_new_tokens=120, ignore_eos=True, lora="a")
        wait_until(
            lambda: eng.call(lambda c: any(r.num_generated for r in c.scheduler.live.values())).result(),
            "the request has sampled a token",
        )
        eng.pause("keep")
        assert not h.done
        with pytest.raises(TimeoutError, match="still in use"):
            eng.update_lora("a", news[1][1], version=6, timeout=0.2)
        landed: list = []
        t = threading.Thread(target=lambda: landed.append(eng.update_lora("a", news[1][1], version=6, timeout=120)))
        t.start()
        time.sleep(0.2)
        assert not landed  # (waiting for the parked request)
        eng.resume()
        out = h.result(timeout=120)
        t.join(timeout=120)
        assert out.generated_tokens == long and out.weight_version == 5 and landed == [6]
        out = eng.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, lora="a")
        assert out.generated_tokens == want[1] and out.weight_version == 6
