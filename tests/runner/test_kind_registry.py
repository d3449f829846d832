"""The registry of layer kinds (``acb.runner.kinds``): the kinds found on the catalogue sweep's tiny
configs (every layer kind of the real checkpoints kept), each attention layer served by one kind,
what each costs, and the prefix and offload rules the model gets from them (the strictest wins)."""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from acb.core.cache_spec import CacheLayout, LayerKindSpec, Offload, PrefixRule
from acb.runner.kv_cache import UNPAGED
from tests.test_model_sweep import ms

# arch -> (kinds found, prefix rule, offload rule) with offload space given
EXPECTED = {
    "llama": (("attention",), "chain", "pages"),
    "gemma4_text": (("attention",), "chain", "pages"),
    "deepseek_v3": (("attention",), "chain", "pages"),  # (expanded heads: mla_latent_cache=False here)
    "deepseek_v32": (("index keys", "attention"), "chain", "pages"),
    "qwen3_next": (("attention", "state"), "snapshot", "row"),
    "mamba2": (("state",), "snapshot", "row"),
    "mamba": (("state",), "snapshot", "row"),  # Mamba1: a hit resumes a token at a time
    "falcon_h1": (("attention", "state"), "snapshot", "row"),
    "kimi_linear": (("attention", "state"), "snapshot", "row"),
    "deepseek_v4": (("unpaged",), "none", "none"),
    "gptj": (("own cache runner",), "snapshot", "none"),
}


@functools.cache
def runner_of(arch: str, mla_latent_cache: bool = False, **cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()
    config = acb.ContinuousBatchingConfig(
        num_blocks=32, page_size=8, cpu_offload_space=0.01, mla_latent_cache=mla_latent_cache, **cfg
    )
    with acb.Engine(model, config) as eng:
        return model, eng.runner.layout, eng.config, eng.runner.kv_cache.spec


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_the_kinds_a_model_has_and_the_rules_it_gets(arch):
    model, layout, cfg, spec = runner_of(arch)
    names, prefix, offload = EXPECTED[arch]
    assert layout.names == names
    assert (layout.prefix_rule.value, layout.offload.value) == (prefix, offload), layout.why
    # the engine runs by the layout's rules
    assert cfg.prefix_caching is (layout.prefix_rule != PrefixRule.NONE)
    assert (cfg.state_snapshots > 0) is (prefix == "snapshot")
    assert (cfg.num_swap_blocks > 0) is (layout.offload != Offload.NONE)
    # each attention layer is served by one kind; the page bytes are the pages' bytes
    attention = [i for k in layout.kinds if k.name in ("attention", "latent", "unpaged") for i in k.layers]
    assert len(attention) == len(set(attention))
    assert layout.page_bytes_per_token * cfg.block_size == spec.bytes_per_block(cfg.block_size) - (
        spec.bytes_per_token().get(UNPAGED, 0) * cfg.block_size
    )
    n = model.config.get_text_config().num_hidden_layers
    assert all(0 <= i < n for k in layout.kinds for i in k.layers)
    if layout.kind("state") is not None:  # a row of state is what one snapshot holds
        state = layout.kind("state")
        assert state.row_bytes > 0 and state.snapshot_bytes == state.row_bytes
    if prefix == "none" or offload == "none":
        assert layout.why  # a weaker rule says why


def test_the_latent_is_a_kind_of_its_own_when_paged():
    model, layout, cfg, spec = runner_of("deepseek_v3", mla_latent_cache=True)
    assert layout.names == ("latent",)
    latent = layout.kind("latent")
    text = model.config.get_text_config()
    elem = torch.finfo(torch.float32).bits // 8
    assert latent.page_bytes_per_token == (text.kv_lora_rank + text.qk_rope_head_dim) * elem * len(latent.layers)


def test_a_state_model_without_offload_space_or_snapshots_says_why():
    _, layout, cfg, _ = runner_of("qwen3_next", state_snapshots=0)
    assert layout.prefix_rule == PrefixRule.NONE and not cfg.prefix_caching
    assert "state_snapshots=0" in layout.why


def test_the_strictest_rule_wins():
    a = LayerKindSpec("attention", (0,), page_bytes_per_token=8)
    s = LayerKindSpec("state", (1,), row_bytes=100, prefix=PrefixRule.SNAPSHOT, offload=Offload.ROW)
    o = LayerKindSpec("unpaged", (2,), token_bytes=4, prefix=PrefixRule.NONE, offload=Offload.NONE, why="w")
    assert CacheLayout((a,)).prefix_rule == PrefixRule.CHAIN
    assert CacheLayout((a, s)).prefix_rule == PrefixRule.SNAPSHOT and CacheLayout((s, a)).offload == Offload.ROW
    assert CacheLayout((o, s, a)).prefix_rule == PrefixRule.NONE and CacheLayout((a, o)).offload == Offload.NONE
    assert CacheLayout((a, s, o)).bytes_per_request(10) == 10 * (8 + 4) + 100
    assert CacheLayout((a, o)).why == "unpaged: w"
