"""Every Python block of the README and docs/ (found by pytest-examples) is compiled, and run on
the embedded tiny model unless it is marked ``<!-- docs-test: compile only (why) -->`` (a GPU,
a cluster, a server or a real checkpoint). Blocks run as notebook cells: top-level ``await``
allowed, in a namespace with the names the docs use (``model``, ``tokenizer``, ``prompts``...)."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest_examples = pytest.importorskip("pytest_examples")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = list(pytest_examples.find_examples(str(ROOT / "README.md"), str(ROOT / "docs")))
MARK = "<!-- docs-test: compile only"


def _marked(example: Any) -> bool:
    lines = Path(example.path).read_text().splitlines()
    before = lines[example.start_line - 2] if example.start_line >= 2 else ""
    return before.strip().startswith(MARK)


def _namespace() -> dict[str, Any]:
    import torch

    import acb
    from acb.models import build_tokenizer, default_model

    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    model = default_model()
    ids = tok("The capital of France is").input_ids
    engine = acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=tok)
    engine.start()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # (a step that changes nothing)
    return dict(acb=acb, json=json, torch=torch, model=model, policy=model, tokenizer=tok, tok=tok,
                prompts=["hello", "a second prompt"], prompt=ids, prompt_ids=ids, list_of_prompt_ids=[ids, ids[:3]],
                context=ids, context_ids=ids, tok_A=ids[0], tok_B=ids[1], cont_ids=ids[:2],
                items=[(ids, [[ids[0]], ids[1:3]])], ctx=ids, conts=[[ids[0]]], steps=2, rounds=2,
                train=lambda m, outs: None, loss=lambda outs: sum(p.sum() for p in model.parameters()) * 0.0,
                optimizer=optimizer, config=acb.ContinuousBatchingConfig(num_blocks=64),
                schema={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
                engine=engine)


@pytest.fixture(scope="module")
def namespace():
    ns = _namespace()
    yield ns
    ns["engine"].shutdown()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{Path(e.path).name}:{e.start_line}")
def test_docs_example(example: Any, namespace: dict[str, Any]) -> None:
    code = compile(example.source, f"{example.path}:{example.start_line}", "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if _marked(example):
        return  # compiled: its syntax holds
    ns = dict(namespace)
    result = eval(code, ns)  # noqa: S307 - the documentation's own code
    if asyncio.iscoroutine(result):  # top-level await: a notebook cell's
        asyncio.run(result)


def test_every_block_is_found_and_most_run():
    assert len(EXAMPLES) >= 15
    assert sum(not _marked(e) for e in EXAMPLES) >= 8
