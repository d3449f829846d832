"""The batch-invariant mode beyond dense attention (acb.runner.batch_invariant_families): a hybrid's
gated-delta-rule state layers (Qwen3.5) and Mamba1/Mamba2's scans give a request the same bits alone, in a
batch of 64 requests of other lengths, chunked at any budget, and after a prefix hit restored from
a state snapshot; images go through the vision tower one a call; and a trainer's forward under
``enabled(model)`` (whole sequences, left-padded) computes exactly the engine's logprobs. Families
with no fixed form are refused with the reason."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import acb
from acb.runner import batch_invariant as bi
from acb.runner import batch_invariant_families as fam
from acb.runner.linear_state import linear_layers
from tests.runner import test_batch_invariant
from tests.runner.test_batch_invariant import TEMP, bits, same, together

SP = replace(test_batch_invariant.SP, max_new_tokens=8)  # seeded sampling at TEMP, processed logprobs


def _family(model_type, seed=0):
    from transformers import AutoModelForCausalLM

    from acb.bench.families import tiny_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hybrid():
    return _family("qwen3_5_text")  # a gated-delta-rule layer, then full attention


@pytest.fixture(scope="module")
def prompts(hybrid):
    vocab = hybrid.config.vocab_size
    rng = random.Random(0)
    target = [rng.randrange(3, vocab) for _ in range(150)]  # past two of the scan's 64-token chunks
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(63)]
    return target, others


def _run(model, prompts, **cfg):
    cfg.setdefault("num_blocks", 400)
    config = acb.ContinuousBatchingConfig(page_size=16, batch_invariant=True, cpu_threads=2, **cfg)
    with acb.Engine(model, config) as eng:
        got = together(eng, prompts, SP)
    return got


@pytest.fixture(scope="module")
def alone(hybrid, prompts):
    return _run(hybrid, [prompts[0]])[0]


def test_hybrid_alone_equals_in_a_batch_of_64_and_chunked(hybrid, prompts, alone):
    target, others = prompts
    # the 64 prompts' 3,000 tokens over 512-token steps: the target's prefill is cut where the
    # others' lengths put the budget's edge
    outs = _run(hybrid, [*others, target], max_batch_tokens=512)
    assert same(outs[-1], alone)
    # alone, chunked at 100 tokens (a state resumed mid-chunk of the scan), async scheduling
    outs = _run(hybrid, [target], max_batch_tokens=100, use_async_batching=True)
    assert same(outs[0], alone)


def test_hybrid_after_a_prefix_hit(hybrid, prompts, alone):
    target, _ = prompts
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=400, batch_invariant=True, allow_block_sharing=True)
    with acb.Engine(hybrid, config) as eng:
        eng.call(lambda core: setattr(core.scheduler.kv, "speculative_min_tokens", 0)).result(timeout=60)
        eng.generate(target[:96], acb.SamplingParams(max_new_tokens=1))  # six whole blocks
        out = eng.submit(target, SP).result()
    assert out.num_cached_tokens == 96  # resumed from the snapshot's state
    assert same(bits(out), alone)


def test_hybrid_trainers_forward_computes_the_engines_logprobs_exactly(hybrid, prompts, alone):
    """Whole sequences, a batch of two, the shorter left-padded (the pads' zeroed inputs leave the
    state exactly zero); the backward runs through the fixed forms."""
    target, others = prompts
    tokens, lps = alone
    short = others[3][:40]
    s_tokens, s_lps = _run(hybrid, [short])[0]
    seqs = [target + tokens, short + s_tokens]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    m = _family("qwen3_5_text")
    m.load_state_dict(hybrid.state_dict())
    with bi.enabled(m):
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits.float().logsumexp(-1).mean().backward()
    for row, (p, t, want) in enumerate([(target, tokens, lps), (short, s_tokens, s_lps)]):
        start = width - len(p) - len(t)
        got = bi.token_logprobs(logits[row, start + len(p) - 1 : width - 1], t, TEMP).double()
        assert torch.equal(got, want), (got - want).abs().max()
    assert all(p.grad is not None for p in m.model.layers[0].linear_attn.parameters())


def test_the_scalar_path_gives_an_element_the_same_bits_at_any_position():
    """torch computes a tensor's last ``numel mod (2 x lanes)`` elements in a scalar loop whose bits
    differ from its vector blocks' (sigmoid, SiLU, softplus): the scalar path does not move."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 4
    for fn in (torch.sigmoid, F.silu, F.softplus):
        whole = fam.scalar_path(fn, x)
        assert all(torch.equal(fam.scalar_path(fn, x[:n]), whole[:n]) for n in range(1, 100))
        assert torch.allclose(whole, fn(x), rtol=1e-6, atol=1e-7)
    moved = sum(not torch.equal(torch.sigmoid(x[:n]), torch.sigmoid(x)[:n]) for n in range(1, 100))
    if moved == 0:
        pytest.skip("this CPU's vector and scalar sigmoid agree here (nothing to show)")


@pytest.mark.parametrize("arch", ["mamba2", "mamba", "lfm2"])
def test_mamba_alone_equals_in_a_batch_of_64_chunked_and_the_trainer(arch):
    """Mamba2's chunk scan (256-token chunks from each call's first token) and Mamba1's selective
    scan run token by token in their decode forms in the mode, the state's read-out a product and a
    sum (Mamba1's ``dt_proj.weight @ x`` the mode's linear); LFM2's short convolution in one fixed
    tap order: the same bits alone, among 63 others, chunked at 100 tokens, and in the trainer's
    forward (a batch of two, the other row left-padded)."""
    model = _family(arch)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    target = [rng.randrange(3, vocab) for _ in range(150)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(63)]
    alone = _run(model, [target])[0]
    assert same(_run(model, [*others, target], max_batch_tokens=512)[-1], alone)
    assert same(_run(model, [target], max_batch_tokens=100)[0], alone)
    tokens, lps = alone
    short = others[0] + [5]
    ids = torch.tensor([target + tokens, [0] * (len(target) + len(tokens) - len(short)) + short])
    mask = (ids != 0) | (torch.arange(ids.shape[1]) >= ids.shape[1] - len(short))
    with bi.enabled(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long()).logits
    assert torch.equal(bi.token_logprobs(logits[0, len(target) - 1 : -1], tokens, TEMP).double(), lps)


def _run_stats(model, prompts, prefix=None, **cfg):
    """:func:`_run`, with the engine's stats, each output's cached tokens, and ``prefix`` generated
    first (a token) for a later prompt's prefix hit."""
    cfg.setdefault("num_blocks", 400)
    config = acb.ContinuousBatchingConfig(page_size=16, batch_invariant=True, cpu_threads=2, **cfg)
    with acb.Engine(model, config) as eng:
        if prefix is not None:  # (snapshots at every whole block of the prefix)
            eng.call(lambda core: setattr(core.scheduler.kv, "speculative_min_tokens", 0)).result(timeout=60)
            eng.generate(prefix, acb.SamplingParams(max_new_tokens=1))
        eng.pause()
        handles = [eng.submit(p, SP) for p in prompts]
        eng.resume()
        outs = [h.result() for h in handles]
        stats = eng.stats
    return [bits(o) for o in outs], outs, stats


@pytest.mark.parametrize("arch", ["kimi_linear", "bailing_hybrid", "minimax", "zaya"])
def test_state_layers_alone_equal_a_batch_chunked_preempted_after_a_hit_and_the_trainer(arch):
    """Kimi's delta attention (Kimi Linear, Ling's hybrid: its chunked form routed to its own
    recurrent form, on contiguous inputs), MiniMax's lightning attention (its own forward, every
    token through its decode branch from a zero state, the products a product and a sum), Zaya's
    CCA projection (its own forward, its two convolutions in one fixed order): a 100-token request
    (past a 64-token chunk) gives the same bits alone, among 23 others of other lengths, chunked at
    40 tokens with async scheduling and a cache small enough to preempt (among 3 others), after a prefix hit on a
    state snapshot, and in the trainer's forward (a batch of two, the other row left-padded, whose
    logprobs are its own in the batch)."""
    model = _family(arch)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    target = [rng.randrange(3, vocab) for _ in range(100)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(23)]
    alone = _run(model, [target])[0]
    batch, _, _ = _run_stats(model, [*others, target], max_batch_tokens=256)
    assert same(batch[-1], alone)
    outs, _, stats = _run_stats(
        model, [*others[:3], target], max_batch_tokens=40, use_async_batching=True, num_blocks=8, cpu_offload_space=0.01
    )
    assert same(outs[-1], alone) and stats.preemptions > 0 and stats.swapped_out_blocks > 0  # (offloaded)
    outs, raw, _ = _run_stats(model, [target], prefix=target[:64], allow_block_sharing=True)
    assert raw[0].num_cached_tokens == 64 and same(outs[0], alone)  # resumed from the snapshot's state
    (tokens, lps), (s_tokens, s_lps) = alone, batch[0]
    short = others[0] + s_tokens
    width = len(target) + len(tokens)
    ids = torch.tensor([target + tokens, [0] * (width - len(short)) + short])
    mask = torch.tensor([[1] * width, [0] * (width - len(short)) + [1] * len(short)])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with bi.enabled(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(bi.token_logprobs(logits[0, len(target) - 1 : -1], tokens, TEMP).double(), lps)
    assert torch.equal(bi.token_logprobs(logits[1, width - len(s_tokens) - 1 : -1], s_tokens, TEMP).double(), s_lps)
    # the backward runs through the fixed forms: a state layer's gradients are the plain forward's to rounding
    layer = linear_layers(model)[0]
    grads = []
    for mode in (bi.enabled(model), contextlib.nullcontext()):
        model.zero_grad()
        with mode:
            model(input_ids=ids[:1, :20]).logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert all((grads[0][n] - g).abs().max() <= 1e-4 * g.abs().max() for n, g in grads[1].items())


def test_the_fixed_convolution_is_torchs_to_rounding():
    x = torch.randn(2, 12, 9, generator=torch.Generator().manual_seed(0))
    for groups, per_group in ((12, 1), (3, 4)):
        w = torch.randn(12, per_group, 3, generator=torch.Generator().manual_seed(1))
        b = torch.randn(12, generator=torch.Generator().manual_seed(2))
        want = F.conv1d(x, w, b, groups=groups)
        assert torch.allclose(fam.fixed_group_conv(x, w, b, groups), want, rtol=1e-5, atol=1e-6)


def test_state_layers_without_a_fixed_form_are_refused_by_name(monkeypatch):
    """Every state layer class acb finds in transformers' models has a fixed form; one without (here
    MiniMax's lightning attention with its form taken away) is refused by its class's name."""
    monkeypatch.delitem(fam._LAYER_FORMS, "MiniMaxLightningAttention")
    with pytest.raises(ValueError, match="MiniMaxLightningAttention"):
        acb.Engine(_family("minimax"), acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True)).start()


@pytest.fixture(scope="module")
def vlm():
    from tests.vlm_models import tiny_vlm

    return tiny_vlm("qwen3_vl")  # M-RoPE positions and DeepStack features from the vision tower


def _chats():
    from tests.vlm_models import image, messages

    target = messages([image(1)], "what is this picture about")
    others = [messages([image(100 + i)] * (1 + i % 2), "describe " + "it " * (i % 7)) for i in range(23)]
    return target, others


def _run_vlm(vlm, chats, **cfg):
    model, processor = vlm
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=600, batch_invariant=True, cpu_threads=2, **cfg)
    with acb.Engine(model, config, processor=processor) as eng:
        got = together(eng, chats, SP)
        calls = eng.runner.media.features.tower_calls
    return got, calls


def test_images_alone_equal_in_a_batch_chunked_and_the_trainers_forward(vlm):
    """A request with an image alone, among 23 others with one or two images each (their images
    in the same steps: an image a tower call), and chunked at 24 tokens (the image's tokens cut);
    the trainer's forward (pixels, M-RoPE and DeepStack by the model's own code) gives exactly
    the engine's logprobs."""
    model, processor = vlm
    target, others = _chats()
    (alone,), _ = _run_vlm(vlm, [target])
    outs, calls = _run_vlm(vlm, [*others, target])
    assert same(outs[-1], alone)
    assert calls == 24  # a call per distinct image (23 others' and the target's)
    (chunked,), _ = _run_vlm(vlm, [target], max_batch_tokens=24)
    assert same(chunked, alone)
    inputs = processor.apply_chat_template(
        target, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    tokens, lps = alone
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], 1)
    kw = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for k in [k for k in kw if k.endswith("token_type_ids")]:  # the completion's tokens are text
        kw[k] = torch.cat([kw[k], kw[k].new_zeros(1, len(tokens))], 1)
    with bi.enabled(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits
        assert model.config.vision_config._attn_implementation == "sdpa"  # the tower keeps its own
    assert torch.equal(bi.token_logprobs(logits[0, n - 1 : -1], tokens, TEMP).double(), lps)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_sigmoid_gates_give_a_token_its_bits_whatever_the_calls_length(arch):
    """An MoE block's sigmoid over a few values per token (DeepSeek-V3's router over 4 experts,
    Qwen3-Next's one-value shared-expert gate): a token last in a call of its length sits in torch's
    scalar tail; in the mode (the block's element-wise ops on the scalar path) its output is the
    one it gets among 60 tokens (without the scalar path, measured: 4 and 7 of 200 tokens differ).
    The engine then runs these models (MLA with a sigmoid router; a gated-delta-rule hybrid with
    a shared-expert gate): alone = in a batch of 64 = the trainer's forward."""
    model = _family(arch)
    block = next(m for m in fam.gate_modules(model) if any(True for _ in m.children()))
    x = torch.randn(1, 60, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    fam.install(model)

    def out(n):
        y = block(x[:, :n])
        return (y[0] if isinstance(y, tuple) else y)[0]

    with bi.enabled(model), torch.no_grad():
        whole = out(60)
        assert all(torch.equal(out(k + 1)[k], whole[k]) for k in range(60))
    rng = random.Random(2)
    vocab = model.config.vocab_size
    target = [rng.randrange(3, vocab) for _ in range(150)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(63)]
    alone = _run(model, [target])[0]
    assert same(_run(model, [*others, target], max_batch_tokens=512)[-1], alone)
    tokens, lps = alone
    with bi.enabled(model), torch.no_grad():
        logits = model(torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
    assert torch.equal(bi.token_logprobs(logits, tokens, TEMP).double(), lps)


def test_lora_alone_equals_in_a_batch_of_64_chunked_and_the_peft_forward(tmp_path, monkeypatch):
    """LoRA on CPU in the mode: each slot's rows through two fixed linears and an add, PEFT's
    order, so a request on an adapter gives the same bits alone, among 63 others on the base, the
    same adapter or another, chunked at 20 tokens; and the trainer's ``PeftModel`` forward under
    ``enabled(model)`` computes exactly its logprobs. The gathered form is refused (fused experts'
    adapters: tests/runner/test_lora_experts.py)."""
    import peft

    from acb.models import tiny_model
    from acb.runner import lora

    ref = peft.get_peft_model(
        tiny_model("llama", seed=3),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
        adapter_name="a",
    )
    ref.add_adapter("b", peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "v_proj"]))
    g = torch.Generator().manual_seed(1)
    for name, p in ref.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    ref.eval()
    folders = {}
    for name in ("a", "b"):
        ref.save_pretrained(tmp_path / name, selected_adapters=[name])
        folders[name] = next((tmp_path / name).rglob("adapter_config.json")).parent
    base = tiny_model("llama", seed=3)
    rng = random.Random(3)
    vocab = base.config.vocab_size
    target = [rng.randrange(3, vocab) for _ in range(60)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(63)]

    def run(prompts, loras, **cfg):
        config = acb.ContinuousBatchingConfig(
            page_size=16, num_blocks=400, batch_invariant=True, max_loras=2, max_lora_rank=8, **cfg
        )
        with acb.Engine(base, config) as eng:
            for name, folder in folders.items():
                eng.add_lora(name, str(folder))
            eng.pause()
            handles = [eng.submit(p, SP, lora=a) for p, a in zip(prompts, loras)]
            eng.resume()
            return [bits(h.result()) for h in handles]

    alone = run([target], ["a"])[0]
    mixed = [[None, "a", "b"][i % 3] for i in range(63)]
    assert same(run([*others, target], [*mixed, "a"], max_batch_tokens=512)[-1], alone)
    assert same(run([target], ["a"], max_batch_tokens=20)[0], alone)
    tokens, lps = alone
    ref.set_adapter("a")
    with bi.enabled(ref), torch.no_grad():
        logits = ref(input_ids=torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
    assert torch.equal(bi.token_logprobs(logits, tokens, TEMP).double(), lps)
    monkeypatch.setattr(lora, "GATHERED", True)
    with pytest.raises(ValueError, match="gathered form"):
        acb.Engine(base, acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True, max_loras=1)).start()
