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
