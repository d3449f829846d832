"""Data-parallel inference on Ray Data (``acb.distributed.ray``), on a local two-CPU Ray.

Two pipelines with two one-CPU actors each run once for the module: 256 token-id prompts in
numpy batches, and text prompts with per-row sampling in pandas batches. Their rows must equal
one in-process ``Engine.generate_batch`` over the same prompts, token for token. The rest
(chats, error rows, a checkpoint path, shutdown) calls the predictor in this process on batches
Ray Data itself made, so that the KV-leak check of tests/conftest.py sees its engine.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import acb  # noqa: E402
from acb.distributed.ray import AcbPredictor, generate_dataset  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")  # Ray's own internals

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"page_size": 16, "num_blocks": 256}
MAX_NEW = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# every row's output columns and the Arrow types they must have
COLUMN_TYPES = {
    "generated_text": "string",
    "generated_token_ids": "list<item: int64>",
    "num_prompt_tokens": "int64",
    "num_generated_tokens": "int64",
    "finish_reason": "string",
    "logprobs": "list<item: double>",
    "worker": "string",
}


def tiny_with_tokenizer() -> tuple:
    """The model factory the actors call: a tiny Llama over the byte tokenizer (with a chat
    template). Module-level, so Ray pickles it by reference and each actor imports this module."""
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tiny_model("llama", vocab_size=len(tok)), tok


def tiny_recording_shutdown(marker_dir: str) -> tuple:
    """``tiny_with_tokenizer`` for an actor whose ``Engine.shutdown`` (patched in that process only)
    leaves a file named after the actor's pid, saying whether the engine still runs after it."""
    original = acb.Engine.shutdown

    def shutdown(self, **kw):
        original(self, **kw)
        Path(marker_dir, str(os.getpid())).write_text(str(self.is_running))

    acb.Engine.shutdown = shutdown
    return tiny_with_tokenizer()


def token_prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


TEXTS = [f"row {i}: " + "the quick brown fox jumps over the lazy dog"[: 5 + 3 * (i % 12)] for i in range(48)]
SHORT = 3  # every 4th text row overrides max_new_tokens to this


def reference(prompts: list, max_new_tokens: int = MAX_NEW, **sampling) -> list[acb.GenerationOutput]:
    """One in-process engine over all the prompts at once."""
    model, tok = tiny_with_tokenizer()
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CONFIG), tokenizer=tok) as engine:
        out = engine.generate_batch(
            prompts, acb.SamplingParams(max_new_tokens=max_new_tokens, **sampling), progress_bar=False
        )
    return list(out.values())


@pytest.fixture(scope="module")
def local_ray():
    """A fresh local Ray (never an existing cluster: address="local", RAY_ADDRESS ignored) in its
    own temp dir, quiet, whose actor pools start every actor before handing out batches; gives
    its address."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        tmp = tempfile.mkdtemp(prefix="acb-ray-")  # short: Ray's socket paths must fit 107 bytes
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 * 2**20,
            _temp_dir=tmp,
            log_to_driver=False,
        )
        ctx = ray.data.DataContext.get_current()
        saved = ctx.wait_for_min_actors_s, ctx.enable_progress_bars
        # a hang guard: the suite's two workers share the cores, and on a loaded machine the actors of
        # the previous test's pool can take a while to release their CPUs (120 s ran out once)
        ctx.wait_for_min_actors_s, ctx.enable_progress_bars = 600, False
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ctx.wait_for_min_actors_s, ctx.enable_progress_bars = saved
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def test_example_runs(local_ray, tmp_path):
    """examples/ray_data_offline.py on the embedded model, as a driver connecting to this
    module's Ray (as it would to a cluster's, with --address)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # Ray's own (RAY_AUTH_MODE...) stay
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "ray_data_offline.py"),
            "--num-prompts",
            "32",
            "--concurrency",
            "2",
            "--max-new-tokens",
            "8",
            "--address",
            local_ray,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # how many of the 2 actors got rows depends on which start first; test_both_actors_did_work checks that
    m = re.search(r"32 rows from [12] actors: (\d+) tokens in [\d.]+ s", p.stdout)
    assert m and 0 < int(m.group(1)) <= 32 * 8, p.stdout
    assert len(re.findall(r"^\[\d+\] .* -> ", p.stdout, re.M)) == 3, p.stdout


@pytest.fixture(scope="module")
def token_rows(local_ray):
    prompts = token_prompts(256)
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)], override_num_blocks=16)
    out = generate_dataset(
        ds,
        model_factory=tiny_with_tokenizer,
        concurrency=2,
        batch_size=16,
        config=CONFIG,
        sampling={"max_new_tokens": MAX_NEW, "logprobs": 0},
        worker_column="worker",
    ).materialize()
    return prompts, out.schema(), sorted(out.take_all(), key=lambda r: r["id"])  # read back, not run again


@pytest.fixture(scope="module")
def text_rows(local_ray, tmp_path_factory):
    rows = [
        {"id": i, "prompt": t, "sampling_params": {"max_new_tokens": SHORT} if i % 4 == 0 else None}
        for i, t in enumerate(TEXTS)
    ]
    ds = ray.data.from_items(rows, override_num_blocks=4)
    markers = tmp_path_factory.mktemp("engine_stopped")
    out = generate_dataset(
        ds,
        model_factory=functools.partial(tiny_recording_shutdown, str(markers)),
        concurrency=2,
        batch_size=8,
        batch_format="pandas",
        config=CONFIG,
        sampling={"max_new_tokens": MAX_NEW},
    )
    return sorted(out.take_all(), key=lambda r: r["id"]), markers


def test_token_prompts_match_generate_batch(token_rows):
    prompts, _, rows = token_rows
    assert [r["id"] for r in rows] == list(range(len(prompts)))  # every row, once
    for row, ref in zip(rows, reference(prompts, logprobs=0)):
        assert list(row["generated_token_ids"]) == ref.generated_tokens
        assert row["generated_text"] == ref.text
        assert row["num_prompt_tokens"] == len(row["prompt"]) and row["num_generated_tokens"] == len(
            ref.generated_tokens
        )
        assert row["finish_reason"] == ref.finish_reason.value
        np.testing.assert_allclose(row["logprobs"], ref.logprobs, atol=1e-4)


def test_columns_are_typed_as_documented(token_rows):
    _, schema, rows = token_rows
    types = dict(zip(schema.names, map(str, schema.types)))
    assert {name: types.get(name) for name in COLUMN_TYPES} == COLUMN_TYPES
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)


def test_both_actors_did_work(token_rows):
    _, _, rows = token_rows
    workers = {r["worker"] for r in rows}
    assert len(workers) == 2 and str(os.getpid()) not in {w.rsplit(":", 1)[1] for w in workers}, workers


def test_text_prompts_and_row_sampling_in_pandas_batches(text_rows):
    text_rows, _ = text_rows
    assert [r["id"] for r in text_rows] == list(range(len(TEXTS)))
    short = [i for i in range(len(TEXTS)) if i % 4 == 0]
    refs = dict(enumerate(reference(TEXTS)))
    refs.update(zip(short, reference([TEXTS[i] for i in short], max_new_tokens=SHORT)))
    for i, row in enumerate(text_rows):
        assert list(row["generated_token_ids"]) == refs[i].generated_tokens, i
        assert row["generated_text"] == refs[i].text
        assert row["num_prompt_tokens"] == len(refs[i].prompt_ids)
    assert all(text_rows[i]["num_generated_tokens"] <= SHORT for i in short)


def test_actors_stop_their_engines(text_rows):
    """Ray Data drops each actor's predictor when the operator ends; that stops its engine."""
    _, markers = text_rows
    deadline = time.monotonic() + 60  # the actors exit after the last rows were handed out
    while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(p.read_text() for p in markers.iterdir()) == ["False", "False"]


# --------------------------------------------------- the predictor in this process


def test_chats_from_ray_batches(local_ray):
    """A chat column as Ray Data hands it over (arrays of dicts) in both batch formats."""
    chats = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}] for i in range(4)
    ]
    ds = ray.data.from_items([{"prompt": c} for c in chats])
    ref = reference(chats)
    predictor = AcbPredictor(model_factory=tiny_with_tokenizer, config=CONFIG, sampling={"max_new_tokens": MAX_NEW})
    try:
        for fmt in ("numpy", "pandas"):
            batch = next(iter(ds.iter_batches(batch_format=fmt, batch_size=4)))
            out = predictor(batch)
            assert isinstance(out, dict if fmt == "numpy" else pd.DataFrame)
            assert [list(t) for t in out["generated_token_ids"]] == [r.generated_tokens for r in ref]
            assert list(out["generated_text"]) == [r.text for r in ref]
    finally:
        predictor.close()


def test_error_rows():
    """on_error="row": a prompt that can never fit and a bad override become error rows; the
    others are generated as usual. on_error="raise" names the row."""
    prompts = np.empty(4, dtype=object)
    prompts[:] = [np.arange(3, 8), np.full(2000, 5), np.arange(10, 14), np.arange(20, 25)]
    overrides = np.array([None, None, {"temperature": -1.0}, {"max_new_tokens": 2}], dtype=object)
    batch = {"prompt": prompts, "sampling_params": overrides}
    predictor = AcbPredictor(
        model_factory=tiny_with_tokenizer, config=CONFIG, on_error="row", sampling=acb.SamplingParams(max_new_tokens=4)
    )
    try:
        out = predictor(batch)
        assert list(out["finish_reason"][1:3]) == ["error", "error"]
        assert "can never fit" in out["error"][1] and "temperature" in out["error"][2]
        assert out["error"][0] is None and out["error"][3] is None
        assert list(out["num_generated_tokens"]) == [4, 0, 0, 2] and list(out["generated_token_ids"][1]) == []
        assert out["num_prompt_tokens"].dtype == np.int64
    finally:
        predictor.close()
    predictor = AcbPredictor(model_factory=tiny_with_tokenizer, config=CONFIG)
    try:
        with pytest.raises(ValueError, match="row 1 of the batch: prompt of 2000 tokens can never fit"):
            predictor({"prompt": prompts[:2]})
        with pytest.raises(ValueError, match=r"already has output column\(s\) \['finish_reason'\]"):
            predictor({"prompt": prompts[:1], "finish_reason": np.array(["x"])})
    finally:
        predictor.close()


REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('this model takes no system messages') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_refusing_system_messages() -> tuple:
    """A tokenizer whose chat template refuses system messages (``raise_exception``), as some
    models' templates refuse roles they lack."""
    model, tok = tiny_with_tokenizer()
    tok.chat_template = REFUSING_TEMPLATE
    return model, tok


def test_a_chat_the_template_refuses_is_one_error_row():
    """on_error="row": a chat the chat template refuses is an error row, the others are
    generated (the template's exception used to fail the whole batch); on_error="raise" names
    the row."""
    chats = np.empty(3, dtype=object)
    chats[:] = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hello"}],
    ]
    predictor = AcbPredictor(
        model_factory=tiny_refusing_system_messages,
        config=CONFIG,
        on_error="row",
        sampling={"max_new_tokens": 3, "ignore_eos": True},
    )
    try:
        out = predictor({"prompt": chats})
    finally:
        predictor.close()
    assert list(out["finish_reason"]) == ["length", "error", "length"]
    assert "this model takes no system messages" in out["error"][1] and out["error"][0] is None
    assert list(out["num_generated_tokens"]) == [3, 0, 3]
    predictor = AcbPredictor(model_factory=tiny_refusing_system_messages, config=CONFIG)
    try:
        with pytest.raises(ValueError, match="row 1 of the batch: the chat template refused this chat"):
            predictor({"prompt": chats})
    finally:
        predictor.close()


def test_checkpoint_path(tmp_path):
    """model= loads a checkpoint with Engine.from_pretrained (model and tokenizer)."""
    model, tok = tiny_with_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    predictor = AcbPredictor(str(tmp_path), config=CONFIG, device="cpu", sampling={"max_new_tokens": MAX_NEW})
    try:
        out = predictor({"prompt": np.array(TEXTS[:3], dtype=object)})
    finally:
        predictor.close()
    assert list(out["generated_text"]) == [r.text for r in reference(TEXTS[:3])]


def test_engine_stops_with_the_predictor(kv_leak_check):
    """Ray Data drops an actor's predictor when the operator ends: collecting it stops the engine
    (kv_leak_check then finds every KV block free)."""
    predictor = AcbPredictor(model_factory=tiny_with_tokenizer, config=CONFIG, sampling={"max_new_tokens": 2})
    predictor({"prompt": np.array(["hello"], dtype=object)})
    (core,) = kv_leak_check
    assert core.is_running
    del predictor
    gc.collect()
    assert not core.is_running


def test_argument_errors():
    with pytest.raises(ValueError, match="exactly one of model"):
        AcbPredictor()
    with pytest.raises(ValueError, match="n > 1 is not supported"):
        AcbPredictor(model_factory=tiny_with_tokenizer, config=CONFIG, sampling={"n": 2})


@pytest.mark.parametrize("offload", [False, True])
def test_async_batching_preemption_and_offload_in_the_actor_engine(offload):
    """The actor's engine with async batching on (the CUDA default) and a KV cache too small
    for the batch, so that requests are preempted (recomputed, or offloaded to host memory):
    the rows still equal the reference, and no KV block leaks (tests/conftest.py)."""
    prompts = token_prompts(24)
    batch = {"prompt": np.empty(len(prompts), dtype=object)}
    batch["prompt"][:] = [np.asarray(p) for p in prompts]
    config = {
        "page_size": 16,
        "num_blocks": 8,
        "use_async_batching": True,
        "cpu_offload_space": 0.01 if offload else 0.0,
    }
    predictor = AcbPredictor(model_factory=tiny_with_tokenizer, config=config, sampling={"max_new_tokens": MAX_NEW})
    try:
        out = predictor(batch)
        stats = predictor.engine.stats
    finally:
        predictor.close()
    assert [list(t) for t in out["generated_token_ids"]] == [r.generated_tokens for r in reference(prompts)]
    assert stats.preemptions > 0
    assert (stats.swapped_out_blocks > 0) == offload


def test_a_scoring_column(local_ray):
    """``continuations_column``: each row's context and continuations scored on the actors (two of
    them, through a real Ray Data pipeline); every row equals one in-process ``score_batch``. A
    row with an empty continuation is an error row with on_error="row"."""
    rng = random.Random(5)
    preamble = [rng.randrange(3, 259) for _ in range(40)]  # shared by every context: the cache pays
    rows = [
        {
            "id": i,
            "prompt": preamble + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 12))],
            "choices": [[rng.randrange(3, 259)] for _ in range(3)] + [[rng.randrange(3, 259) for _ in range(3)]],
        }
        for i in range(24)
    ]
    rows[5]["choices"] = [[7], []]
    ds = ray.data.from_items(rows, override_num_blocks=4)
    out = sorted(
        generate_dataset(
            ds,
            model_factory=tiny_with_tokenizer,
            concurrency=2,
            batch_size=6,
            config=CONFIG,
            continuations_column="choices",
            on_error="row",
        ).take_all(),
        key=lambda r: r["id"],
    )
    model, tok = tiny_with_tokenizer()
    good = [r for r in rows if r["id"] != 5]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CONFIG), tokenizer=tok) as engine:
        ref = engine.score_batch([(r["prompt"], r["choices"]) for r in good], progress_bar=False)
    for r, want in zip([o for o in out if o["id"] != 5], ref):
        assert r["error"] is None
        np.testing.assert_allclose(list(r["continuation_logprobs"]), [c.logprob for c in want.continuations], atol=1e-5)
        for got, c in zip(r["continuation_token_logprobs"], want.continuations):
            np.testing.assert_allclose(list(got), c.logprobs, atol=1e-5)
        assert list(r["continuation_greedy"]) == [c.greedy for c in want.continuations]
    assert "continuations[1] is empty" in out[5]["error"] and list(out[5]["continuation_logprobs"]) == []
    assert sum(r["num_cached_tokens"] for r in out) > 0  # rows of a batch met in the prefix cache
