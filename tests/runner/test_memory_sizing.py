"""Memory sizing: blocks from the budget minus a step's workspace, and a clear error when one
maximal request cannot fit."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.runner import kv_cache
from acb.runner.kv_cache import step_workspace_bytes
from acb.runner.setup import resolve_config
from tests.conftest import get_model


def test_auto_sizing_counts_workspace(monkeypatch):
    model = get_model("llama")
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 64 << 20)  # 64 MiB of RAM
    cfg, spec = resolve_config(
        model,
        acb.ContinuousBatchingConfig(
            page_size=16, max_memory_percent=0.5, max_batch_tokens=256, max_requests_per_batch=8
        ),
    )
    budget = (64 << 20) // 2
    workspace = step_workspace_bytes(model, 256, 8, torch.float32)
    per_block = spec.bytes_per_block(16)
    useful = 8 * (1024 // 16) + 1  # every running request at the model's full length
    assert cfg.num_blocks == min((budget - workspace) // per_block, useful)
    assert cfg.max_model_len == 1024


def test_too_little_memory_for_one_request_is_a_clear_error(monkeypatch):
    model = get_model("llama")
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match="not enough memory for one request of max_model_len=1024"):
        resolve_config(model, acb.ContinuousBatchingConfig(page_size=16, max_memory_percent=0.5))
    # a shorter max_model_len fits
    cfg, _ = resolve_config(
        model,
        acb.ContinuousBatchingConfig(
            page_size=16, max_memory_percent=0.5, max_model_len=64, max_batch_tokens=64, max_requests_per_batch=4
        ),
    )
    assert cfg.max_model_len == 64 and cfg.num_blocks >= 5


def test_max_model_len_limits_requests():
    model = get_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, max_model_len=40)) as eng:
        with pytest.raises(ValueError, match="at most 40 tokens"):
            eng.submit(list(range(3, 43)))
        out = eng.generate(list(range(3, 33)), acb.SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert len(out.generated_tokens) == 10 and out.finish_reason == acb.FinishReason.LENGTH


def test_offload_space_clamped_by_safety_threshold(monkeypatch):
    model = get_model("llama")
    monkeypatch.setattr("acb.runner.setup.available_host_memory", lambda: 1 << 20)

    def swap_blocks(**kw):
        cfg, spec = resolve_config(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=32, **kw))
        return cfg.num_swap_blocks, spec.bytes_per_block(16)

    blocks, per_block = swap_blocks(cpu_offload_space=1.0, cpu_offload_space_safety_threshold=0.5)
    assert blocks == (1 << 19) // per_block  # 1 GiB asked, half of the 1 MiB available granted
    # transformers' meaning of the edge values: threshold 0 turns offload off, None sizes it to the cap
    assert swap_blocks(cpu_offload_space=1.0, cpu_offload_space_safety_threshold=0.0)[0] == 0
    assert swap_blocks(cpu_offload_space=None, cpu_offload_space_safety_threshold=0.25)[0] == (1 << 18) // per_block
    assert swap_blocks(cpu_offload_space=0.0)[0] == 0


def test_triton_backend_refused_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        acb.Engine(get_model("llama"), acb.ContinuousBatchingConfig(attn_backend="triton", num_blocks=16)).start()


def test_a_per_layer_intermediate_size_is_sized_by_its_widest_layer():
    """Gemma 3n's configs give intermediate_size per layer (a list): the step workspace counts the
    widest layer's MLP, as an int intermediate_size of that width would."""
    from types import SimpleNamespace

    def model_with(inter):
        text = SimpleNamespace(hidden_size=64, intermediate_size=inter, vocab_size=256)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))

    wide = step_workspace_bytes(model_with(512), 128, 4, torch.float32)
    assert step_workspace_bytes(model_with([128, 512, 256]), 128, 4, torch.float32) == wide
    assert step_workspace_bytes(model_with((512,)), 128, 4, torch.float32) == wide
    with pytest.raises(TypeError, match="expects an int or a list of ints"):
        step_workspace_bytes(model_with("wide"), 128, 4, torch.float32)


def test_per_layer_attention_shapes_are_refused_with_the_field():
    """One page shape serves every layer: a config whose head counts or head size differ by layer (a
    list, or transformers' per-layer read error) is refused at start, naming the field."""
    from types import SimpleNamespace

    from acb.runner.model_support import refusal

    class PerLayer(SimpleNamespace):
        @property
        def num_attention_heads(self):
            raise RuntimeError("differs per layer")  # (transformers: AmbiguousGlobalPerLayerAttributeError)

    for text, field in (
        (SimpleNamespace(num_key_value_heads=[2, 4]), "num_key_value_heads"),
        (PerLayer(), "num_attention_heads"),
    ):
        model = type("PerLayerForCausalLM", (), {})()
        model.config = SimpleNamespace(get_text_config=lambda text=text: text)
        why = refusal(model)
        assert why is not None and "per-layer attention shapes" in why and field in why
