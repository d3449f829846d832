"""Images in, text out: vision-language models through the engine, exact against ``model.generate``.

Seven tiny random VLMs built in code (:mod:`tests.vlm_models`: Qwen3-VL with DeepStack and
four-row M-RoPE, Qwen3.5 with linear-attention layers, Gemma 3 whose image tokens attend both
ways, LLaVA-OneVision, Idefics3, InternVL, LLaVA), each with its own processor; and Gemma 4, whose
image tokens attend both ways on its sliding layers when its config says so. Requests with one
image, two images of different sizes and none run in one batch; greedy tokens must equal
``model.generate`` on the same processor outputs, whole, with chunk boundaries inside an image's
tokens, and under preemption with async batching. Scoring an image prompt equals a plain
forward's log-softmax; the prefix cache never shares K/V between two requests whose images differ.
"""

from __future__ import annotations

import base64
import io
import re

import pytest
import torch

import acb
from acb.errors import UnsupportedModelError
from acb.runner.media import MediaAttention, bidirectional_layers, media_attention
from tests.vlm_models import (
    ARCHS,
    image,
    messages,
    molmo2_prompt,
    tiny_gemma4,
    tiny_molmo2,
    tiny_paligemma,
    tiny_vlm,
)

MAX_NEW = 6


def chats() -> list[list[dict]]:
    return [
        messages([image(1)], "describe this"),
        messages([image(2), image(3, (40, 56))], "two images"),
        [{"role": "user", "content": "text only"}],
        messages([image(4)], "another one, with a longer text"),
    ]


def processed(arch: str, chat: list[dict]):
    _, processor = tiny_vlm(arch)
    return processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def reference(arch: str, chat: list[dict], max_new: int = MAX_NEW) -> list[int]:
    model, _ = tiny_vlm(arch)
    inputs = processed(arch, chat)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


MODES = {
    "whole": dict(num_blocks=64, page_size=8),
    # chunks of 7 tokens: boundaries fall inside every image's tokens (but Gemma 3's blocks)
    "chunked": dict(num_blocks=64, page_size=8, max_batch_tokens=7),
    "preempt-async": dict(num_blocks=30, page_size=4, max_batch_tokens=16, use_async_batching=True),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_and_without_images(arch, mode):
    model, processor = tiny_vlm(arch)
    cs = chats()
    with acb.Engine(model, acb.ContinuousBatchingConfig(**MODES[mode]), processor=processor) as eng:
        outs = eng.generate_batch(cs, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
        got = [o.generated_tokens for o in outs.values()]
        if mode == "preempt-async":
            assert eng.stats.preemptions > 0
        # the vision encoder ran once per request with images, whatever the chunks and recomputes
        assert eng.runner.media.captures == 3
        # Gemma 3's image tokens see their whole image on every layer (the others: on none)
        assert eng.runner.media.layers == ({0, 1} if arch == "gemma3" else set())
    assert got == [reference(arch, c) for c in cs]


# Gemma 4 (transformers' Gemma4Model.forward and create_masks_for_vision_model): with
# use_bidirectional_attention="vision", an image's tokens see each other both ways on the sliding
# layers and causally on the full ones; with None (the smaller models') every layer is causal. The
# greedy tokens of the first two chats tell causal, sliding layers only and every layer apart.
GEMMA4_CHATS = [
    messages([image(4)], "describe this"),
    messages([image(4)], "what is it?"),
    messages([image(2), image(3, (40, 56))], "two images"),
]


def test_gemma4_image_attention_follows_its_config_and_layer_types():
    """Gemma 4's image tokens attend as its own code decides, from its config and per layer type:
    exact against ``model.generate`` for ``use_bidirectional_attention`` None and "vision", whole
    and in prefill chunks (never cut inside an image) with async batching. (acb once applied both
    ways to every layer of every Gemma 4, decided from the model's code alone.)"""
    want = {}
    for setting in (None, "vision"):
        model, processor = tiny_gemma4(setting)
        want[setting] = []
        for chat in GEMMA4_CHATS:
            inputs = processor.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
            want[setting].append(out[0, inputs["input_ids"].shape[1] :].tolist())
    assert want[None][:2] != want["vision"][:2]  # (the setting changes these chats' tokens)
    sliding = {i for i, kind in enumerate(model.config.text_config.layer_types) if kind == "sliding_attention"}
    for setting in (None, "vision"):
        model, processor = tiny_gemma4(setting)
        for mode in (dict(), dict(max_batch_tokens=16, use_async_batching=True)):
            cfg = acb.ContinuousBatchingConfig(num_blocks=96, page_size=8, **mode)
            with acb.Engine(model, cfg, processor=processor) as eng:
                assert eng.runner.media.layers == (sliding if setting else set())
                outs = eng.generate_batch(GEMMA4_CHATS, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
            assert [o.generated_tokens for o in outs.values()] == want[setting], (setting, mode)


def test_image_layers_are_read_from_the_models_own_masks(monkeypatch):
    """The layers whose image tokens attend both ways are read from the masks the model's own code
    builds, whatever its attention implementation (SDPA's boolean masks, eager's additive ones):
    per image, or one block for all of a prompt's images (Molmo2's); a mask acb cannot reproduce
    (text tokens that see later ones) refuses the model's images."""
    model, _ = tiny_vlm("gemma3")
    own = model.config._attn_implementation
    try:
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            assert bidirectional_layers(model) == {0, 1}, impl
    finally:
        model.set_attn_implementation(own)
    import transformers.models.gemma3.modeling_gemma3 as gemma3

    blocks = gemma3.get_block_sequence_ids_for_mask
    monkeypatch.setattr(gemma3, "get_block_sequence_ids_for_mask", lambda t, device=None: torch.where(t == 1, 0, -1))
    assert media_attention(model) == MediaAttention(frozenset({0, 1}), one_block=True)
    monkeypatch.setattr(gemma3, "get_block_sequence_ids_for_mask", lambda t, device=None: torch.where(t == 0, 0, -1))
    with pytest.raises(UnsupportedModelError, match="let text tokens see later tokens"):
        bidirectional_layers(model)
    # blocks only in prompts longer than the probe's: the probe sees a causal model, and the request's
    # own masks refuse it when its images are embedded (before, it ran causal: other tokens)
    monkeypatch.setattr(
        gemma3, "get_block_sequence_ids_for_mask", lambda t, device=None: blocks(t * (t.shape[-1] > 8), device)
    )
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8)) as eng:
        assert eng.runner.media.layers == set()
        out = eng.generate_batch([processed("gemma3", chats()[0])], max_new_tokens=2, progress_bar=False)
    (res,) = out.values()
    assert res.status == acb.RequestStatus.FAILED
    assert "mask for this prompt lets token" in (res.error or "") and "refused" in (res.error or "")


def test_gemma4_per_layer_inputs_with_images():
    """An E2B/E4B-style Gemma 4 (per-layer inputs, KV-shared layers): its own code computes the
    per-layer inputs from ``input_ids`` (an image token's as the pad token's), which a forward on
    ``inputs_embeds`` lacks; acb hands them over, its own for image requests. Exact against
    ``model.generate`` with text and image requests in one batch, whole and chunked with async
    batching (every request of a step with images failed before, the text ones too)."""
    model, processor = tiny_gemma4(None, per_layer=True)
    cs = [GEMMA4_CHATS[0], [{"role": "user", "content": "text only"}], GEMMA4_CHATS[2]]
    want = []
    for chat in cs:
        inputs = processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    for mode in (dict(), dict(max_batch_tokens=16, use_async_batching=True)):
        cfg = acb.ContinuousBatchingConfig(num_blocks=96, page_size=8, **mode)
        with acb.Engine(model, cfg, processor=processor) as eng:
            outs = eng.generate_batch(cs, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
        assert [o.generated_tokens for o in outs.values()] == want, mode


def test_image_masks_acb_cannot_follow_are_refused():
    """Models whose image masks are not Gemma 3's per-image blocks, found by what their masks do.
    Molmo2 puts every image token of a prompt in one block (an image sees the later images, across
    the text between them): a prompt with one image is exact against ``model.generate`` (whole, and
    chunked with async batching; its image tensors index each other, so its images are embedded
    request by request), one with two is refused at submit (before, it ran causal: other tokens).
    PaliGemma's prompt attends both ways whole (a prefix-LM): its images are refused, saying why,
    its text is exact; with the config's flag off its masks still say so, and refuse it."""
    model = tiny_molmo2()
    words = [[40, 41, 42, 43, 44, 45], [60, 61, 62, 63, 64, 65], [66, 61, 62, 63, 64, 65]]
    prompts: list = [molmo2_prompt(seed, 1, w) for seed, w in zip((1, 3, 4), words)]
    text = [1, 5, 6, 7, 8, 9, 10] * 3
    want = []
    for p in [
        *prompts,
        {"input_ids": torch.tensor([text]), "attention_mask": torch.ones(1, len(text), dtype=torch.long)},
    ]:
        with torch.no_grad():
            out = model.generate(**p, max_new_tokens=MAX_NEW, do_sample=False)
        want.append(out[0, p["input_ids"].shape[1] :].tolist())
    for mode in (dict(), dict(max_batch_tokens=7, use_async_batching=True)):
        with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, **mode)) as eng:
            assert eng.runner.media.one_block and eng.runner.media.layers == {0, 1}
            outs = eng.generate_batch([*prompts, text], max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
            with pytest.raises(acb.InvalidRequestError, match="prompts with one image .*this one has 2"):
                eng.generate(molmo2_prompt(2, 2, words[0]), max_new_tokens=2)
        assert [o.generated_tokens for o in outs.values()] == want, mode

    model, processor = tiny_paligemma()
    ids = [1, 70, 71, 85, 69, 84, 75, 68, 71, 223] * 2
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids) :].tolist()
    text_config = model.config.text_config
    try:
        for flag, says in ((True, "the paged path refuses it: .*bidirectional attention"), (False, "text tokens see")):
            text_config.use_bidirectional_attention = flag
            with acb.Engine(
                model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor
            ) as eng:
                with pytest.raises(acb.InvalidRequestError, match="this engine cannot run images: .*" + says):
                    eng.generate(messages([image(1)], "describe this"), max_new_tokens=2)
                if flag:
                    assert eng.generate(ids, max_new_tokens=MAX_NEW, ignore_eos=True).generated_tokens == want
    finally:
        text_config.use_bidirectional_attention = True


@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3", "idefics3"])
def test_samples_scoring_and_processed_inputs(arch):
    """``n = 2`` forks an image request's KV; a processor's output (a ``BatchFeature``) is a prompt
    as good as the chat it came from; scoring an image prompt's continuations equals the log-softmax
    of a plain forward with the same processor outputs."""
    model, processor = tiny_vlm(arch)
    chat = chats()[1]
    want = reference(arch, chat)
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor) as eng:
        out = eng.generate(chat, max_new_tokens=MAX_NEW, ignore_eos=True, n=2)
        assert [s.generated_tokens for s in out.samples] == [want, want]
        assert eng.generate(processed(arch, chat), max_new_tokens=MAX_NEW, ignore_eos=True).generated_tokens == want
        inputs = processed(arch, chats()[0])
        conts = [[40, 41, 42], [43], [40, 44]]
        scores = eng.score_batch([(inputs, conts)], progress_bar=False)[0]
    ctx = inputs["input_ids"][0].tolist()
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for cont, score in zip(conts, scores.continuations):
        ids = torch.tensor([ctx + cont])
        kw = dict(extra)
        for name in ("token_type_ids", "mm_token_type_ids"):  # (per-token: extended over the continuation)
            if name in kw:
                kw[name] = torch.cat([kw[name], kw[name].new_zeros((1, len(cont)))], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0, len(ctx) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(score.logprobs), lp, atol=1e-4), (score.logprobs, lp.tolist())


@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3", "llava"])
def test_requests_admitted_together_share_one_vision_call(arch):
    """The image requests a step admits go through the model's own vision code in one padded
    call (its batch, as the processor would make it), and stay exact."""
    model, processor = tiny_vlm(arch)
    cs = [messages([image(30 + i)], f"request {i} " * (i + 1)) for i in range(4)]
    # (no prefix caching: requests sharing a prompt prefix would otherwise wait a step for its blocks)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, allow_block_sharing=False)
    with acb.Engine(model, cfg, processor=processor) as eng:
        outs = eng.generate_batch(cs, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
        assert eng.runner.media.captures == 4 and eng.runner.media.capture_calls == 1
    assert [o.generated_tokens for o in outs.values()] == [reference(arch, c) for c in cs]


@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3", "llava"])
def test_offloaded_image_requests_resume_exactly(arch):
    """Preempted image requests go to host memory and come back (no recompute): exact, and M-RoPE
    positions and image rows still right after the swap."""
    model, processor = tiny_vlm(arch)
    cs = chats()
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=30, page_size=4, max_batch_tokens=16, use_async_batching=True, cpu_offload_space=0.01
    )
    with acb.Engine(model, cfg, processor=processor) as eng:
        outs = eng.generate_batch(cs, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False)
        assert eng.stats.preemptions > 0 and eng.stats.swapped_in_blocks > 0
    assert [o.generated_tokens for o in outs.values()] == [reference(arch, c) for c in cs]


def test_the_prefix_cache_keys_include_the_images():
    """Same text, another image: no K/V shared past the first image token (and other tokens); the
    same image and text: shared."""
    model, processor = tiny_vlm("llava")
    a, b = messages([image(1)], "same text"), messages([image(2)], "same text")
    first = processed("llava", a)["input_ids"][0].tolist().index(model.config.image_token_id)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4)
    with acb.Engine(model, cfg, processor=processor) as eng:
        one = eng.generate(a, max_new_tokens=MAX_NEW, ignore_eos=True)
        other = eng.generate(b, max_new_tokens=MAX_NEW, ignore_eos=True)
        again = eng.generate(a, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert other.num_cached_tokens == first // 4 * 4  # the text before the image only
    assert again.num_cached_tokens > first
    assert one.generated_tokens == again.generated_tokens == reference("llava", a)
    assert other.generated_tokens == reference("llava", b) != one.generated_tokens


@pytest.mark.anyio
async def test_async_submit_streams_an_image_request():
    """``AsyncEngine.submit`` with images (processed in a worker thread), streamed; OpenAI's
    ``image_url`` data-URL parts are taken as ``image`` parts are."""
    model, processor = tiny_vlm("qwen3_vl")
    buf = io.BytesIO()
    image(1).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe this"}],
        }
    ]
    async with acb.AsyncEngine(
        model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor
    ) as eng:
        handle = await eng.submit(chat, max_new_tokens=MAX_NEW, ignore_eos=True)
        streamed = [t async for delta in handle for t in delta.token_ids]
        out = await handle.result()
    assert streamed == out.generated_tokens == reference("qwen3_vl", chats()[0])


def test_refusals_name_what_is_wrong():
    model, processor = tiny_vlm("llava")
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor) as eng:
        bad = [{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}]
        with pytest.raises(acb.InvalidRequestError, match="image 0: cannot decode"):
            eng.generate(bad, max_new_tokens=2)
        remote = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
        ]
        with pytest.raises(acb.InvalidRequestError, match="remote URLs are not fetched"):
            eng.generate(remote, max_new_tokens=2)
    # embeddings that can never fit the engine's image budget: refused at submit, by size
    small = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, image_cache_bytes=1024)
    with acb.Engine(model, small, processor=processor) as eng:
        with pytest.raises(acb.InvalidRequestError, match="image_cache_bytes"):
            eng.generate(chats()[0], max_new_tokens=2)
    # a text-only model
    from tests.conftest import get_model

    with acb.Engine(
        get_model("llama"), acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor
    ) as eng:
        with pytest.raises(acb.InvalidRequestError, match="takes no images"):
            eng.generate(chats()[0], max_new_tokens=2)


def test_scoring_a_fresh_image_context_and_a_childs_failure(monkeypatch):
    """Qwen's per-token types cover a scoring child's longer prompt (its capture once failed on
    a fresh engine); a group whose child fails carries the child's error, not None."""
    model, processor = tiny_vlm("qwen3_vl")
    inputs = processed("qwen3_vl", chats()[0])
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8)
    with acb.Engine(model, cfg, processor=processor) as eng:
        out = eng.score_batch([(inputs, [[40, 41, 42]])], progress_bar=False)[0]
        assert out.status == acb.RequestStatus.FINISHED and len(out.continuations[0].logprobs) == 3
    from acb.runner.media import MediaEmbedder

    capture = MediaEmbedder._capture

    def child_fails(self, reqs):
        if any("#" in req.request_id for req in reqs):
            raise RuntimeError("the child's capture broke")
        return capture(self, reqs)

    monkeypatch.setattr(MediaEmbedder, "_capture", child_fails)
    with acb.Engine(model, cfg, processor=processor) as eng:
        out = eng.score_batch([(inputs, [[40, 41, 42], [43, 44]])], progress_bar=False)[0]
    assert out.status == acb.RequestStatus.FAILED and "the child's capture broke" in (out.error or "")


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature and header claiming ``width`` x ``height`` RGB pixels, with no pixel data:
    a size check that reads the header refuses it before anything is decoded or allocated."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def solid_png(width: int, height: int) -> bytes:
    """A one-colour PNG (a few hundred bytes however long it is)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


# images of extreme shapes: tiny, one pixel wide or high up to the aspect-ratio limit (served, exact),
# and past it, or too large decoded or as the processor would make them (refused at submit, naming
# the image and the limit, before the processor runs)
SERVED_SIZES = [(1, 1), (1, 200), (200, 1), (3, 2)]
REFUSED = {
    "1x201": (solid_png(1, 201), "201 times longer one way"),
    "30000x1": (solid_png(30000, 1), "30,000 times longer one way"),
    "1x30000": (solid_png(1, 30000), "30,000 times longer one way"),
    "huge": (png_header(9000, 8000), "9000x8000 pixels is more than the 67,108,864 allowed"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_images_of_extreme_shapes_are_served_exactly_or_refused_by_size(arch):
    """The image fuzz's extreme shapes on every VLM: what passes the size checks is exact against
    ``model.generate``; what does not is refused at submit with an ``InvalidRequestError`` that says
    which limit, and the engine serves on. LLaVA-OneVision pads an image to a square before it
    resizes: a 9000x45 strip (405k pixels) would be 81M pixels there, and is refused for it alone."""
    model, processor = tiny_vlm(arch)
    served = [messages([image(60 + i, size)], "what is this") for i, size in enumerate(SERVED_SIZES)]
    strip = [messages([image(70, (9000, 45))], "a strip")]
    refused = {**REFUSED}
    if arch == "llava_onevision":
        refused["9000x45"] = (strip[0][0]["content"][0]["image"], "would make 9000x9000 pixels")
    else:
        served += strip
    cfg = acb.ContinuousBatchingConfig(num_blocks=128, page_size=8)
    with acb.Engine(model, cfg, processor=processor) as eng:
        for name, (img, says) in refused.items():
            chat = messages([img], "what is this")
            with pytest.raises(acb.InvalidRequestError, match="image 0: .*" + re.escape(says)) as info:
                eng.generate(chat, max_new_tokens=2)
            assert info.value.field == "prompt", name
        outs = eng.generate_batch(served, max_new_tokens=4, ignore_eos=True, progress_bar=False)
    assert [o.generated_tokens for o in outs.values()] == [reference(arch, c, 4) for c in served]
