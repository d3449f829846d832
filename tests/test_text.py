"""Text in, text out: prompts as text and chats, streaming detokenization (tokenizers built in code)."""

from __future__ import annotations

import functools
import random

import pytest

import acb
from acb.models import build_tokenizer, tiny_model
from acb.text import IncrementalDetokenizer
from tests.conftest import reference_generate

TEXT = "héllo wörld 😀 日本語 ok 👍🏽! ça va?"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@functools.cache
def byte_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@functools.cache
def sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer: '▁' marks a word's leading space, which decode drops at
    the start of the text, so a token's text depends on its neighbour."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("▁" + TEXT.replace(" ", "") + "abcdefghijklmnopqrstuvwxyz"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    merges = [("▁", "h"), ("▁", "w"), ("▁", "o"), ("o", "k")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make", [byte_tokenizer, sentencepiece_tokenizer])
def test_pieces_add_up_to_the_full_decode(make):
    tok = make()
    ids = tok(TEXT)["input_ids"] + tok("  more words here")["input_ids"]
    want = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for trial in range(40):
        rng = random.Random(trial)
        d = IncrementalDetokenizer(tok)
        pieces, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            pieces.append(d.push(ids[i : i + k]))
            i += k
        pieces.append(d.flush())
        assert all("\ufffd" not in p for p in pieces)  # no broken character is ever emitted
        assert "".join(pieces) == want
    if make is byte_tokenizer:  # the emoji's four bytes are four tokens: it came out whole
        emoji = tok("😀", add_special_tokens=False)["input_ids"]
        assert len(emoji) == 4
        d = IncrementalDetokenizer(tok)
        assert [d.push([t]) for t in emoji] == ["", "", "", "😀"]


def test_a_trailing_incomplete_character_is_flushed_at_the_end():
    tok = byte_tokenizer()
    ids = tok("a😀", add_special_tokens=False)["input_ids"][:-1]  # the emoji cut short
    d = IncrementalDetokenizer(tok)
    held = d.push(ids)
    assert "\ufffd" not in held  # held back while the character is incomplete
    assert held + d.flush() == tok.decode(ids, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=len(byte_tokenizer()))


def cfg():
    return acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)


async def test_text_and_chat_prompts_stream_text(model):
    tok = byte_tokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀"}]
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids  # (a BatchEncoding in some versions)
    sp = acb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    async with acb.AsyncEngine(model, cfg(), tokenizer=tok) as eng:
        by_text = await eng.generate("héllo wörld", sp)
        by_ids = await eng.generate(tok("héllo wörld")["input_ids"], sp)
        h = await eng.submit(chat, sp)
        deltas = [d async for d in h]
        out = await h.result()
        two = await eng.generate("ça va?", acb.SamplingParams(max_new_tokens=6, n=2, ignore_eos=True))
    assert by_text.prompt_ids == by_ids.prompt_ids and by_text.generated_tokens == by_ids.generated_tokens
    assert out.prompt_ids == list(chat_ids)
    assert out.generated_tokens == reference_generate(model, list(chat_ids), 12)
    full = tok.decode(out.generated_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(d.text or "" for d in deltas) == out.text == full
    assert by_text.text == tok.decode(
        by_text.generated_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    for s in two.samples:
        assert s.text == tok.decode(s.generated_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_text_without_a_tokenizer_is_refused(model):
    with acb.Engine(model, cfg()) as eng:
        with pytest.raises(TypeError, match="no tokenizer: pass tokenizer="):
            eng.submit("hello")
        with pytest.raises(TypeError, match="no tokenizer"):
            eng.submit([{"role": "user", "content": "hi"}])
        out = eng.generate([5, 6], acb.SamplingParams(max_new_tokens=2))
    assert out.text is None  # no tokenizer, no text


def test_generate_batch_with_text_and_from_pretrained(model, tmp_path):
    tok = byte_tokenizer()
    outs = acb.generate_batch(
        model, ["héllo", "wörld"], continuous_batching_config=cfg(), tokenizer=tok, max_new_tokens=5, progress_bar=False
    )
    for o in outs.values():
        assert o.text == tok.decode(o.generated_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    eng = acb.Engine.from_pretrained(str(tmp_path), cfg(), dtype="float32")
    with eng:
        out = eng.generate("héllo", acb.SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert out.generated_tokens == reference_generate(model, tok("héllo")["input_ids"], 5)
    assert out.text is not None
