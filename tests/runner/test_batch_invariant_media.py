"""The batch-invariant mode with image tokens that attend to each other both ways in prefill
(acb.runner.batch_invariant_media): Gemma 3 (every layer), Gemma 4 with
``use_bidirectional_attention="vision"`` (its sliding layers, a window of 8 shorter than its
70-token images) and Molmo2 (a prompt's images one block). A request with an image gives the same
tokens and logprob bits alone, among 23 others (images and text of other lengths), chunked at a
small budget (chunks stop at an image's edges), after a prefix hit, and with async batching and a
cache small enough to preempt; a trainer's forward under ``enabled(model)`` (the model's own
masks, read per query as a key range) computes exactly the engine's logprobs."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import acb
from acb.runner import batch_invariant as bi
from acb.runner.batch_invariant_masks import mask_ranges
from tests.runner import test_batch_invariant
from tests.runner.test_batch_invariant import TEMP, bits, same, together
from tests.vlm_models import image, messages, molmo2_prompt, tiny_gemma4, tiny_molmo2, tiny_vlm

SP = replace(test_batch_invariant.SP, max_new_tokens=8)  # seeded sampling at TEMP, processed logprobs
ARCHS = ("gemma3", "gemma4", "molmo2")


def _model(arch):
    if arch == "gemma3":
        return tiny_vlm("gemma3")
    if arch == "gemma4":
        return tiny_gemma4("vision")
    return tiny_molmo2(), None


def _prompts(arch):
    """The target (an image between texts), 23 others (one or two images, or text alone) and the
    target's twin (its image and first tokens, other text after the image)."""
    rng = random.Random(0)
    if arch == "molmo2":  # (one image a prompt: Molmo2's one block)
        target = molmo2_prompt(1, 1, [40, 41, 42, 43, 44, 45])
        twin = molmo2_prompt(1, 1, [40, 41, 42, 90, 91, 92])
        others: list = []
        for i in range(23):
            words = [rng.randrange(3, 300) for _ in range(6)]
            if i % 3 == 2:
                others.append([1, *(rng.randrange(3, 300) for _ in range(rng.randrange(5, 60)))])
            else:
                others.append(molmo2_prompt(100 + i, 1, words))
        return target, others, twin
    target = messages([image(1)], "what is this picture about")
    twin = messages([image(1)], "say something else")
    with_images = (lambda i: i % 4 != 0) if arch == "gemma3" else (lambda i: i % 3 == 1)  # (Gemma 4's: 64 tokens)
    others = [
        messages([image(100 + i)] * (1 + i % 2), "describe " + "it " * (i % 7))
        if with_images(i)
        else [{"role": "user", "content": "no picture " * (1 + i % 4)}]
        for i in range(23)
    ]
    return target, others, twin


def _run(arch, prompts, **cfg):
    model, processor = _model(arch)
    cfg.setdefault("num_blocks", 600)
    cfg.setdefault("page_size", 16)
    config = acb.ContinuousBatchingConfig(batch_invariant=True, cpu_threads=2, **cfg)
    with acb.Engine(model, config, processor=processor) as eng:
        got = together(eng, prompts, SP)
        stats = eng.stats
    return got, stats


_ALONE: dict = {}


def _alone(arch):
    if arch not in _ALONE:
        target, _, _ = _prompts(arch)
        _ALONE[arch] = _run(arch, [target])[0][0]
    return _ALONE[arch]


# a cache too small for the batch (preemptions), big enough for its longest prompt
SMALL_CACHE = {"gemma3": 24, "gemma4": 40, "molmo2": 16}


@pytest.mark.parametrize("arch", ARCHS)
def test_alone_equals_in_a_batch_preempted_chunked_and_after_a_prefix_hit(arch):
    target, others, twin = _prompts(arch)
    alone = _alone(arch)
    # among 23 others (their images in the same steps), async batching, preempted and recomputed
    outs, stats = _run(
        arch,
        [*others, target],
        max_batch_tokens=256,
        use_async_batching=True,
        num_blocks=SMALL_CACHE[arch],
        page_size=8,
        cpu_offload_space=0.01,
    )
    assert same(outs[-1], alone)
    assert stats.preemptions > 0 and stats.swapped_out_blocks > 0  # (preempted rows offloaded)
    (chunked,), _ = _run(arch, [target], max_batch_tokens=12)  # (a chunk takes a whole image past it)
    assert same(chunked, alone)
    # after its twin: the prefix hit ends inside the image (the chunk starts mid-image and its image
    # tokens read the cached ones before them and the fresh ones after)
    model, processor = _model(arch)
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=600, batch_invariant=True, cpu_threads=2)
    with acb.Engine(model, config, processor=processor) as eng:
        eng.submit(twin, replace(SP, max_new_tokens=1)).result()
        out = eng.submit(target, SP).result()
    kinds = next(v for k, v in _inputs(arch, target).items() if k.endswith("token_type_ids"))[0]
    first, last = kinds.nonzero()[[0, -1], 0].tolist()
    assert first < out.num_cached_tokens <= last
    assert same(bits(out), alone)


def _inputs(arch, chat):
    """The model's own inputs for a prompt (its processor's outputs; Molmo2's made by hand)."""
    if arch == "molmo2":
        return dict(chat)
    _, processor = _model(arch)
    return dict(
        processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
    )


def _extended(inputs, tokens):
    """``inputs`` with ``tokens`` appended (text: 0 in the per-token types)."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([tokens])], 1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    for k in [k for k in out if k.endswith("token_type_ids")]:
        out[k] = torch.cat([out[k], out[k].new_zeros(1, len(tokens))], 1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_trainers_forward_computes_the_engines_logprobs_exactly(arch):
    model, _ = _model(arch)
    target, _, _ = _prompts(arch)
    tokens, lps = _alone(arch)
    inputs = _inputs(arch, target)
    n = inputs["input_ids"].shape[1]
    with bi.enabled(model), torch.no_grad():
        logits = model(**_extended(inputs, tokens)).logits
    assert torch.equal(bi.token_logprobs(logits[0, n - 1 : -1], tokens, TEMP).double(), lps)


def test_gemma3_trainer_batch_left_padded_with_a_backward():
    """Two sequences with images, the shorter left-padded (each query's keys start at its row's
    first token and end at its image's end); the backward runs through the same masks."""
    model, _ = _model("gemma3")
    target, others, _ = _prompts("gemma3")
    short = others[1]
    (a, b), _ = _run("gemma3", [target, short])
    rows = [_extended(_inputs("gemma3", c), t) for c, (t, _) in zip((target, short), (a, b))]
    width = max(r["input_ids"].shape[1] for r in rows)

    def left(t, fill=0):
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=fill)

    batch = {
        "input_ids": torch.cat([left(r["input_ids"]) for r in rows]),
        "attention_mask": torch.cat([left(r["attention_mask"]) for r in rows]),
        "token_type_ids": torch.cat([left(r["token_type_ids"]) for r in rows]),
        "pixel_values": torch.cat([r["pixel_values"] for r in rows]),
    }
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # each row's from 0
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with bi.enabled(model):
            logits = model(**batch).logits
            logits.float().logsumexp(-1).mean().backward()
        for row, (t, want) in enumerate((a, b)):
            end = width - len(t)
            got = bi.token_logprobs(logits[row, end - 1 : width - 1], t, TEMP).double()
            assert torch.equal(got, want), (got - want).abs().max()
        assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad is not None
    finally:
        for p in params:
            p.grad = None


def test_a_mask_the_kernel_cannot_follow_is_refused():
    """A trainer mask in which a query sees keys that are not one range ending at or past its own
    position (a hole) is refused, not computed as another."""
    s = 6
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    mask[4, 2] = False  # query 4 skips key 2
    with pytest.raises(ValueError, match="image's tokens seeing"):
        mask_ranges(mask[None, None], 1, s, s, None, None)
    blocks = torch.ones(s, s, dtype=torch.bool).tril()
    blocks[1:3, 1:3] = True  # tokens 1-2: an image whose tokens see each other
    pads, ends = mask_ranges(blocks[None, None], 1, s, s, None, None)
    assert pads == [0] and ends is not None and ends[0].tolist() == [1, 3, 3, 4, 5, 6]


def test_the_kernels_window_is_measured_from_the_querys_position():
    """acb's kernel with ``pos_of``: a query whose keys run past its own position (to its image's
    end) has its sliding window start at its position's, as the model's mask has it; without
    ``pos_of`` (its position is its last key's) the bits are the old call's."""
    from acb.runner.attention import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"no CPU kernel here ({cpu_kernels.problem()})")
    g = torch.Generator().manual_seed(0)
    n, h, kvh, d, page = 40, 4, 2, 16, 8
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n // page, page, kvh, d, generator=g)
    v = torch.randn(n // page, page, kvh, d, generator=g)
    table = torch.arange(n // page)[None].contiguous()
    rows, toks = torch.zeros(n, dtype=torch.long), torch.arange(n)
    pos = torch.arange(n)
    ends = torch.where((pos >= 10) & (pos < 30), 30, pos + 1)  # positions 10-29: an image
    window = 6

    def call(lens, at):
        out = torch.zeros(n, h, d)
        cpu_kernels.paged_attention(q, k, v, table, rows, toks, lens, out, 0.25, None, window, None, None, at)
        return out

    got = call(ends, pos)
    kf, vf = (t.reshape(n, kvh, d).repeat_interleave(h // kvh, 1) for t in (k, v))
    kpos = torch.arange(n)[None]
    allow = (kpos < ends[:, None]) & (kpos > pos[:, None] - window)
    w = torch.einsum("qhd,khd->hqk", q, kf).mul(0.25).masked_fill(~allow, float("-inf"))
    want = torch.einsum("hqk,khd->qhd", w.softmax(-1), vf)
    assert torch.allclose(got, want, atol=1e-5)
    plain = pos + 1
    assert torch.equal(call(plain, None), call(plain, pos))  # (None: the position is the last key's)
    assert not torch.allclose(call(ends, None)[10:29], want[10:29], atol=1e-3)  # (the window from the end)
