"""Image features cached per image (``acb.runner.media.ImageFeatures``): the vision tower runs
once per distinct image, whatever text comes with it, and a step's new images go to it in one
call; exact against ``model.generate``, within the image budget.

The model's own feature method (``get_image_features``, which each VLM's forward calls with the
pixel values) is counted by wrapping the class's method: acb serves it from its cache during a
capture and calls the class's method for what is not cached.
"""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from acb.runner import media as runner_media
from tests.vlm_models import image, messages, molmo2_prompt, tiny_molmo2, tiny_vlm

MAX_NEW = 4


def reference(arch: str, chat: list[dict], max_new: int = MAX_NEW) -> list[int]:
    model, processor = tiny_vlm(arch)
    inputs = processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def count_tower_calls(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module) -> list[int]:
    """A counter of the calls of the model's own image-feature method (the inner model's)."""
    calls = [0]
    cls = type(model.model)
    own = cls.get_image_features

    @functools.wraps(own)  # (its signature: acb cuts a call by its arguments' names)
    def counted(self, *args, **kwargs):
        calls[0] += 1
        return own(self, *args, **kwargs)

    monkeypatch.setattr(cls, "get_image_features", counted)
    return calls


def generate(eng: acb.Engine, chats: list[list[dict]], max_new: int = MAX_NEW) -> list[list[int]]:
    outs = eng.generate_batch(chats, max_new_tokens=max_new, ignore_eos=True, progress_bar=False)
    return [o.generated_tokens for o in outs.values()]


# one kind of cut each: Qwen's flattened patches by image_grid_thw rows (DeepStack's per-layer
# tuples too), Gemma 3's pixel rows and a tensor of features, LLaVA-OneVision's images by its
# per-sample counts, InternVL's tiles (every family's tokens: tests/api/test_images.py, cache on)
@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3", "llava_onevision", "internvl"])
def test_one_image_runs_the_tower_once_whatever_the_text(arch, monkeypatch):
    """Requests with distinct images admitted together go through the tower in one call; the same
    images again, with other questions, do not run it at all; every token equals ``generate``'s.
    (Before, each request's images went through the tower with each request: 2 calls, 4 images.)"""
    model, processor = tiny_vlm(arch)
    calls = count_tower_calls(monkeypatch, model)
    # (no prefix caching: requests sharing a prompt prefix would otherwise wait a step for its blocks)
    cfg = acb.ContinuousBatchingConfig(num_blocks=96, page_size=8, allow_block_sharing=False)
    first = [messages([image(40)], "what is this"), messages([image(41)], "describe it")]
    again = [messages([image(41)], "and this one, what colour"), messages([image(40)], "say more")]
    with acb.Engine(model, cfg, processor=processor) as eng:
        features = eng.runner.media.features
        # warm-up: the first joined outputs are checked once against the model's own (a run more)
        generate(eng, [messages([image(50)], "a"), messages([image(51)], "b")], 1)
        generate(eng, [messages([image(51)], "c"), messages([image(50)], "d")], 1)
        assert features.on and {"join", "split"} <= features.verified, features.why_off
        calls[0], computed, hits = 0, features.computed, features.hits
        got = generate(eng, first)
        assert calls[0] == 1  # both new images in one call
        new = features.computed - computed
        assert new > 0 and features.hits == hits
        got += generate(eng, again)
        assert calls[0] == 1 and features.hits == hits + new  # the same images again: not run
        assert eng.runner.media.captures == 8  # (each request's own prompt still goes through the model)
    assert got == [reference(arch, c) for c in first + again]


def test_a_tiny_budget_evicts_features_and_stays_exact():
    """The cached features' bytes count in ``image_cache_bytes`` with the requests' embeddings:
    under a budget that holds one request's embeddings only, the features are let go (and the tower
    runs again for the same image), and the tokens stay exact; with room, they are kept and
    counted."""
    model, processor = tiny_vlm("qwen3_vl")
    chats = [messages([image(42)], "what is this"), messages([image(42)], "and now"), messages([image(43)], "x")]
    want = [reference("qwen3_vl", c) for c in chats]
    for budget in (6 << 10, 1 << 20):
        cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, image_cache_bytes=budget)
        with acb.Engine(model, cfg, processor=processor) as eng:
            embedder = eng.runner.media
            assert eng.runner.cfg.image_cache_bytes == budget
            got = [generate(eng, [c])[0] for c in chats]  # one at a time
            generate(eng, [[{"role": "user", "content": "text"}]], 1)  # (its step lets the last row's entry go)
            held = embedder.nbytes()
            assert held <= budget
            if budget < 1 << 20:
                # one image's features (8 KiB) are more than the budget: evicted, image 42 ran twice
                assert (embedder.features.computed, embedder.features.hits) == (3, 0)
            else:
                assert (embedder.features.computed, embedder.features.hits) == (2, 1)  # image 42 once
                assert embedder.features.nbytes > 0
                assert held > embedder.features.nbytes  # (the requests' entries, kept for reuse, too)
        assert got == want, budget


def test_features_joined_unlike_the_models_own_are_not_used(monkeypatch):
    """The first joined features are checked against the model's own run: a cut that gave other
    features (here: each cached part's rows scaled) turns the cache off for the model, and the
    tokens stay the model's own."""
    model, processor = tiny_vlm("llava")
    join = runner_media._join

    def scaled(kind, parts):  # (LLaVA's features: a list of one tensor per image)
        joined = join(kind, parts)
        return type(joined)(t * 1.5 for t in joined) if isinstance(joined, (list, tuple)) else joined * 1.5

    monkeypatch.setattr(runner_media, "_join", scaled)
    chats = [messages([image(44)], "what is this"), messages([image(44)], "tell me again")]
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8), processor=processor) as eng:
        got = [generate(eng, [c])[0] for c in chats]
        features = eng.runner.media.features
        assert not features.on and "differ from its own" in features.why_off and features.nbytes == 0
    assert got == [reference("llava", c) for c in chats]


def test_images_that_refer_to_each_other_keep_the_request_path(monkeypatch):
    """Molmo2's pooling indices point into every crop of the call: its calls are not cut per
    image (they run whole, uncached), and its tokens are exact."""
    model = tiny_molmo2()
    calls = count_tower_calls(monkeypatch, model)
    prompts = [molmo2_prompt(1, 1, [40, 41, 42, 43]), molmo2_prompt(1, 1, [60, 61, 62, 63])]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(**p, max_new_tokens=MAX_NEW, do_sample=False)
        want.append(out[0, p["input_ids"].shape[1] :].tolist())
    calls[0] = 0
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8)) as eng:
        got = [eng.generate(p, max_new_tokens=MAX_NEW, ignore_eos=True).generated_tokens for p in prompts]
        features = eng.runner.media.features
        assert features.uncut_calls == 2 and features.computed == 0 and features.nbytes == 0
    assert calls[0] == 2 and got == want
