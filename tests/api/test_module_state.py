"""Models that keep a request's state in their modules' attributes, outside the cache object
(``acb.runner.module_state``): RecurrentGemma with real checkpoints' block pattern (recurrent,
recurrent, attention), and a Llama given such state by hand, which must not slip onto the paged
path. Each runs one request at a time with its own values of those attributes, exact against
``model.generate`` in tokens and in logprobs (the tiny models' tokens alone rarely flip when a
request runs on another's state; their logprobs always move), batched, preempted, async, n > 1.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import acb
from tests.conftest import prompts_of_lengths

MAX_NEW = 8


def recurrent_gemma(lru_width: int) -> torch.nn.Module:
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    config = RecurrentGemmaConfig(
        num_hidden_layers=3,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        lru_width=lru_width,
        attention_window_size=32,
        conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"],  # the released checkpoints' pattern
    )
    torch.manual_seed(0)
    return RecurrentGemmaForCausalLM(config).eval()


class _RunningMean(torch.nn.Module):
    """An MLP wrapper that mixes in the mean of the hidden states it has seen so far, kept in a
    module attribute: state outside the cache object, in a model the paged path could run."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum(dim=1, keepdim=True) if self.seen is None else self.seen + x.sum(dim=1, keepdim=True)
        count = x.shape[1] + (0 if self.count is None else self.count)
        self.seen, self.count = total, torch.as_tensor(count)
        return self.inner(x) + total / count


def llama_with_state() -> torch.nn.Module:
    from acb.models import tiny_model

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = _RunningMean(layer.mlp)
    return model


@functools.cache
def model_of(name: str) -> torch.nn.Module:
    if name == "llama_with_state":
        return llama_with_state()
    return recurrent_gemma(int(name.rsplit("_", 1)[1]))


def reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from ``model.generate`` on the prompt alone."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]


def fresh_state(model: torch.nn.Module) -> None:
    """``_RunningMean`` starts every ``model.generate`` call from nothing (RecurrentGemma resets
    itself at position 0)."""
    for m in model.modules():
        if isinstance(m, _RunningMean):
            m.seen = m.count = None


def references(name: str, ps: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    model = model_of(name)
    out = []
    for p in ps:
        fresh_state(model)
        out.append(reference(model, p))
    fresh_state(model)
    return out


NAMES = ["recurrent_gemma_64", "recurrent_gemma_48", "llama_with_state"]  # lru_width = hidden_size, and not


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(num_blocks=12, page_size=4, max_batch_tokens=32, use_async_batching=True),  # preemption, async
    ],
    ids=["whole", "preempt-async"],
)
@pytest.mark.parametrize("name", NAMES)
def test_each_request_runs_on_its_own_module_state(name, cfg, caplog):
    """Requests batched (and preempted, under async batching) give ``model.generate``'s tokens
    and logprobs: each runs on its own values of the model's module attributes."""
    ps = prompts_of_lengths([5, 9, 7, 6] if "num_blocks" in cfg else [5, 17, 30, 9], vocab=256, seed=1)
    refs = references(name, ps)
    model = model_of(name)
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **cfg})
    with caplog.at_level(logging.INFO, logger="acb"), acb.Engine(model, config) as eng:
        assert eng.runner.own_cache_runner is not None and eng.runner.own_cache_runner.module_state is not None
        outs = list(
            eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False, logprobs=0).values()
        )
        if "num_blocks" in cfg:
            assert eng.stats.preemptions > 0
    assert "keeps per-request state in module attributes" in caplog.text
    assert [o.generated_tokens for o in outs] == [t for t, _ in refs]
    for o, (_, lps) in zip(outs, refs):
        assert list(o.logprobs) == pytest.approx(lps, abs=1e-5)


def test_samples_fork_the_module_state():
    """``n = 3`` children start from their parent's prompt state (a copy of its values)."""
    name = "recurrent_gemma_48"
    p = prompts_of_lengths([13], vocab=256, seed=3)[0]
    ((tokens, _),) = references(name, [p])
    with acb.Engine(model_of(name), acb.ContinuousBatchingConfig(num_blocks=64, page_size=8)) as eng:
        out = eng.generate(p, max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
    assert [s.generated_tokens for s in out.samples] == [tokens] * 3


def test_the_paged_path_refuses_module_state_by_name():
    """Forcing the paged path on a model with module state fails at start and names the
    attributes; without forcing, the engine chose the own-cache path (above)."""
    with pytest.raises(acb.UnsupportedModelError, match=r"module attributes .*mlp\.seen"):
        acb.Engine(model_of("llama_with_state"), acb.ContinuousBatchingConfig(num_blocks=16, runner="paged")).start()
    model = model_of("llama_with_state")
    assert all(m.seen is None for m in model.modules() if isinstance(m, _RunningMean))  # put back after the try
