"""Weight updates into a running engine (``update_weights``, ``load_weights``): atomic, checked
whole before anything is written, swapped between two steps; the prefix cache dropped; every
output carries the weight version its tokens were sampled under, as spans when an update landed
while it ran (``pause(mode="keep")``)."""

from __future__ import annotations

import copy

import pytest
import torch

import acb
from tests.conftest import get_model, prompts_of_lengths, reference_generate, wait_until

CFG = dict(num_blocks=64, page_size=8)


def fresh_model():
    return copy.deepcopy(get_model("llama"))


def shifted(model, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter: the model's, plus noise."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_update_weights_swaps_between_steps_and_versions_every_output():
    model = fresh_model()
    twin = fresh_model()  # the reference: the same updates, applied by hand
    ps = prompts_of_lengths([9, 17], seed=3)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        before = eng.generate(ps[0], max_new_tokens=8, ignore_eos=True)
        assert before.weight_version == 0 and before.generated_tokens == reference_generate(twin, ps[0], 8)
        new = shifted(model, 1)
        assert eng.update_weights(new) == 1 and eng.weight_version == 1
        twin.load_state_dict(new, strict=False)
        after = eng.generate(ps[0], max_new_tokens=8, ignore_eos=True)
        assert after.weight_version == 1 and after.num_cached_tokens == 0  # (the prefix cache was dropped)
        assert after.generated_tokens == reference_generate(twin, ps[0], 8) != before.generated_tokens
        part = list(shifted(model, 2).items())[:3]
        assert eng.update_weights(part, version="step-7") == "step-7"
        for name, value in part:
            twin.get_parameter(name).data.copy_(value)
        out = eng.generate(ps[1], max_new_tokens=8, ignore_eos=True)
        assert out.weight_version == "step-7" and out.generated_tokens == reference_generate(twin, ps[1], 8)


def test_a_bad_update_writes_nothing_and_says_what_was_wrong():
    model = fresh_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    name, param = next(iter(model.named_parameters()))
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        good = {n: p.detach() + 1 for n, p in model.named_parameters()}
        for bad, says in [
            ({**good, "model.nope.weight": torch.zeros(3)}, "model.nope.weight: the model has no such"),
            ({**good, name: torch.zeros(param.shape[0] + 1, *param.shape[1:])}, f"{name}: shape"),
            ({**good, name: torch.zeros(param.shape, dtype=torch.long)}, f"{name}: dtype torch.int64"),
        ]:
            with pytest.raises(acb.WeightUpdateError, match=says):
                eng.update_weights(bad)
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert eng.weight_version == 0
        with pytest.raises(acb.WeightUpdateError, match="no such checkpoint"):
            eng.load_weights("/nonexistent/checkpoint")
        eng.update_weights({name: param.detach().double() * 2})  # another float dtype: cast
        assert torch.equal(param.detach(), before[name] * 2) and eng.weight_version == 1


def test_load_weights_from_a_safetensors_checkpoint(tmp_path):
    model = fresh_model()
    trained = fresh_model()
    trained.load_state_dict(shifted(trained, 5), strict=False)
    trained.save_pretrained(tmp_path / "ckpt")
    p = prompts_of_lengths([12], seed=4)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        assert eng.load_weights(tmp_path / "ckpt", version=3) == 3
        out = eng.generate(p, max_new_tokens=8, ignore_eos=True)
    assert out.weight_version == 3 and out.generated_tokens == reference_generate(trained, p, 8)


@pytest.mark.parametrize("async_batching", [False, True])
def test_pause_keep_across_an_update_gives_version_spans(async_batching):
    """A request parked by ``pause("keep")`` while the weights change finishes after ``resume``
    (on the K/V it had: vLLM's and SGLang's meaning); its spans say which of its tokens came from
    which version, and match a reference that swaps the weights at the same token."""
    model = fresh_model()
    twin = fresh_model()
    p = prompts_of_lengths([10], seed=6)[0]
    cfg = acb.ContinuousBatchingConfig(**CFG, use_async_batching=async_batching)
    new = shifted(model, 7)
    with acb.Engine(model, cfg) as eng:
        h = eng.submit(p, max_new_tokens=12, ignore_eos=True)

        def generated(core) -> int:  # (on the engine thread, between two steps)
            req = core.scheduler.live.get(h.request_id)
            return 12 if req is None else req.num_generated

        wait_until(lambda: eng.call(generated).result(timeout=60) >= 4, "four tokens generated")
        eng.pause("keep")
        eng.update_weights(new)
        eng.resume()
        out = h.result(timeout=120)
    spans = out.weight_version
    assert isinstance(spans, list) and [v for v, _, _ in spans] == [0, 1]
    (_, a0, a1), (_, b0, b1) = spans
    assert a0 == 0 and a1 == b0 and b1 == 12 and 4 <= a1 < 12
    first = reference_generate(twin, p, a1)
    assert out.generated_tokens[:a1] == first
    # the parked request keeps its K/V: what the old weights computed for the prompt and the
    # tokens fed before the swap, then the new weights from the last sampled token on
    with torch.no_grad():
        cache = twin(torch.tensor([p + first[:-1]]), use_cache=True).past_key_values
        twin.load_state_dict(new, strict=False)
        rest, token = [], first[-1]
        for _ in range(12 - a1):
            step = twin(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
            rest.append(token)
    assert out.generated_tokens[a1:] == rest


# tiny MoE configs (every expert's tensors written one by one by save_pretrained)
_MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
MOE = {
    "mixtral": dict(_MOE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
}


def _moe(arch: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **MOE[arch]), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "llava"])
def test_load_weights_takes_the_folder_save_pretrained_writes(arch, tmp_path):
    """Mixtral and Qwen3-MoE checkpoints keep each expert's tensors apart, LLaVA's its
    ``language_model.model.*`` names; ``load_weights`` converts them as ``from_pretrained`` does
    (every model class of the sweep: ``tests/runner/test_checkpoint_names.py``), and the engine
    then generates what the saved model generates."""
    if arch == "llava":
        from tests.vlm_models import image, messages, tiny_vlm

        base, processor = tiny_vlm("llava")
        model, trained = copy.deepcopy(base), copy.deepcopy(base)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        chat = messages([image(1)], "describe this")
        inputs = processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            out = trained.generate(**inputs, max_new_tokens=8, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1] :].tolist()
        prompt, kwargs = chat, {"processor": processor}
    else:
        model, trained = _moe(arch, 0), _moe(arch, 1)
        prompt = prompts_of_lengths([13], seed=8)[0]
        want, kwargs = reference_generate(trained, prompt, 8), {}
    trained.save_pretrained(tmp_path / "ckpt")
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG), **kwargs) as eng:
        before = eng.generate_batch([prompt], max_new_tokens=8, ignore_eos=True, progress_bar=False)
        assert eng.load_weights(tmp_path / "ckpt", version=2) == 2
        after = eng.generate_batch([prompt], max_new_tokens=8, ignore_eos=True, progress_bar=False)
    (b,), (a,) = before.values(), after.values()
    assert a.weight_version == 2 and a.generated_tokens == want != b.generated_tokens
    saved = dict(trained.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())


BAD_VERSIONS = [
    ([7, 8], "got list \\[7, 8\\] \\(a list is how an output reports"),
    (float("nan"), "an int or a str; got float nan"),
    (1.5, "got float 1.5"),
    (True, "got bool True"),
    ({"step": 1}, "got dict"),
    ("", "a non-empty str"),
    ("x" * 300, "at most 256 characters; got 300"),
    (2**64, "signed 64-bit range"),
    ("\ud800", "encodes as UTF-8"),
]


def test_a_version_outputs_cannot_carry_is_refused_before_anything_lands(tmp_path):
    """A list (the form of an output's spans) or a NaN as the version had been taken, and broke
    every later output; now each is refused, naming ``weight_version``, with nothing written, and
    the engine goes on with its weights and version (an int of numpy's is an int)."""
    import numpy as np

    model = fresh_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = shifted(model, 9)
    fresh_model().save_pretrained(tmp_path / "ckpt")
    p = prompts_of_lengths([11], seed=2)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        for bad, says in BAD_VERSIONS:
            for update in (
                lambda v: eng.update_weights(new, version=v),
                lambda v: eng.load_weights(tmp_path / "ckpt", version=v),
            ):
                with pytest.raises(acb.WeightUpdateError, match=f"weight_version.*{says}"):
                    update(bad)
        assert eng.weight_version == 0 and all(torch.equal(t, before[n]) for n, t in model.named_parameters())
        out = eng.generate(p, max_new_tokens=6, ignore_eos=True)
        assert out.weight_version == 0 and out.generated_tokens == reference_generate(fresh_model(), p, 6)
        assert eng.update_weights(new, version=np.int64(12)) == 12 and type(eng.weight_version) is int
        assert eng.generate(p, max_new_tokens=6, ignore_eos=True).weight_version == 12


def test_a_peft_adapter_switch_drops_the_prefix_cache():
    """Switching a PEFT adapter off (``disable_adapter()``), to another (``set_adapter``), merging
    and unmerging it change no parameter the way the other signals see (a merge writes through
    ``.data``); the weights key holds the adapter layers' state, so the prefix cache is dropped
    and every request, its prompt all cached otherwise, equals ``PeftModel.generate``."""
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(
        fresh_model(),
        peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    pm.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj"], init_lora_weights=False))
    pm.eval()
    p = prompts_of_lengths([20], seed=5)[0]

    def want() -> list[int]:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        return out[0, len(p) :].tolist()

    seen = []
    with acb.Engine(pm, acb.ContinuousBatchingConfig(**CFG, allow_block_sharing=True)) as eng:

        def check(state: str, cached: bool = False) -> None:
            out = eng.generate(p, max_new_tokens=8, ignore_eos=True)
            assert out.generated_tokens == want(), state
            assert (out.num_cached_tokens > 0) == cached, state
            seen.append(tuple(out.generated_tokens))

        check("default adapter")
        check("default adapter, again", cached=True)  # (the prefix cache is on, and hits)
        with pm.disable_adapter():
            check("adapters disabled")
        check("default adapter after the block")
        pm.set_adapter("other")
        check("the other adapter")
        pm.merge_adapter()
        check("the other adapter merged")
        pm.unmerge_adapter()
        check("the other adapter unmerged")
    assert len(set(seen)) >= 3  # (the base's, each adapter's: they differ)
