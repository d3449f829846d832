"""HTTP helpers shared by the serve tests: one plain request, and the check of an OpenAI error body."""

from __future__ import annotations

import http.client
import json


def raw(port: int, method: str, path: str, body=None, headers=None, timeout: float = 60):
    """One plain HTTP request: (status, lower-cased headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def check_error_body(body: bytes, status: int | None = None) -> dict:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    doc = json.loads(body)
    assert set(doc) == {"error"}, (status, doc)
    err = doc["error"]
    assert {"message", "type", "param", "code"} <= set(err), (status, err)
    assert isinstance(err["message"], str) and err["message"], (status, err)
    assert isinstance(err["type"], str) and err["type"], (status, err)
    return err


def tiny_checkpoint(tmp_path_factory, name: str, chat_template: str, max_positions: int):
    """A tiny random Llama and the byte-level tokenizer (with ``chat_template``) saved to a fresh
    folder: ``.dir``, ``.model``, ``.tok`` (loaded back from the folder, as a server loads it)
    and ``.eos``."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from acb.models import build_tokenizer, tiny_model

    tok = build_tokenizer()
    tok.chat_template = chat_template
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=max_positions)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return SimpleNamespace(dir=d, model=model, tok=AutoTokenizer.from_pretrained(d), eos=model.config.eos_token_id)
