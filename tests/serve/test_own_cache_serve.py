"""``acb serve`` on a model only the second runner path runs (GPT-J: attention outside
transformers' attention interface), as a real process with the ``openai`` client: completions
and streamed chat, greedy, equal to ``model.generate``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from acb.models import build_tokenizer  # noqa: E402
from tests.conftest import reference_generate  # noqa: E402
from tests.serve.test_openai_server import CHAT, CHAT_TEMPLATE, _serve, chat_ids, decode  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = AutoConfig.for_model(
        "gptj",
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=512,
        n_inner=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    d = tmp_path_factory.mktemp("tiny-gptj")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return SimpleNamespace(dir=d, model=model, tok=AutoTokenizer.from_pretrained(d), eos=model.config.eos_token_id)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    yield from _serve(checkpoint, tmp_path_factory, "gptj", ["--served-model-name", "gptj", "--num-blocks", "128"])


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_completions_and_streamed_chat_equal_generate(server, client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    texts = ["héllo", "ça va? 😀 and a longer prompt"]
    refs = [reference_generate(model, tok(t)["input_ids"], 10) for t in texts]
    both = client.completions.create(model="gptj", prompt=texts, max_tokens=10, temperature=0)
    by_index = {c.index: c.text for c in both.choices}
    assert [by_index[0], by_index[1]] == [decode(tok, r) for r in refs]
    ids = chat_ids(tok, CHAT)
    ref = reference_generate(model, ids, 12)
    chunks = list(
        client.chat.completions.create(model="gptj", messages=CHAT, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == decode(tok, ref)
