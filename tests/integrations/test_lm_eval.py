"""lm-eval model "acb" against lm-eval's own "hf" backend on the same tiny checkpoint.

Three local tasks (multiple choice, generation with stop strings, rolling loglikelihood) run
through ``lm_eval.simple_evaluate`` with both backends; every logged sample must agree
(loglikelihoods to 1e-4, greedy flags and generated strings exactly) and so must the metrics.
``max_length=48`` for both, so left truncation and several rolling windows per document happen.
"""

from __future__ import annotations

import copy
import gc
import glob
import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from acb.core.engine_core import EngineCore  # noqa: E402
from acb.integrations.lm_eval import AcbLM  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["acb_test_mc", "acb_test_gen", "acb_test_roll", "acb_test_fewshot"]
MAX_LENGTH = 48
MAX_GEN_TOKS = 12

MC_QUESTIONS = [
    "Question: what is 2+2?\nAnswer:",
    "The capital of France is",
    "Once upon a",
    "",
    "a long context that the window must cut from the left, " * 3,
    "Colors: red, green,",
]
GEN_PROMPTS = [
    "Once upon a time",
    "abc def ghi",
    "Hello there! " * 6,
    "The weather today is " * 3,
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
    "x",
]
ROLL_TEXTS = ["The quick brown fox jumps over the lazy dog. " * 4, "short", "Lorem ipsum dolor sit amet, " * 2]

# keep lm-eval and datasets from looking anything up online
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _greedy_text(model, tok, text: str, n: int) -> list[int]:
    ids = tok.encode(text) or [tok.bos_token_id]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def _printable_prefix(tok, ids: list[int]) -> str:
    """The longest prefix of ``ids`` that decodes to printable ASCII (it encodes back to the same ids)."""
    text = ""
    for t in ids:
        piece = tok.decode([t])
        if not (piece.isascii() and piece.isprintable()):
            break
        text += piece
    return text


def _write_task(path: Path, name: str, data: Path, body: str) -> None:
    path.write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A saved tiny checkpoint (random weights, byte-level tokenizer) and three tasks over it.

    Built from the model's own greedy outputs so that the checks bite: some multiple-choice
    answers are the greedy continuation (is_greedy true), the stop strings are characters the
    model does generate, and one generation target is ``model.generate``'s text cut at the stop.
    """
    d = tmp_path_factory.mktemp("lm_eval")
    tok = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=256)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")

    mc = []
    for i, q in enumerate(MC_QUESTIONS):
        greedy = _printable_prefix(tok, _greedy_text(model, tok, q, 3))
        choices = [c for c in (greedy, " yes", " no", "maybe") if c]
        mc.append({"q": q, "choices": choices, "gold": i % len(choices)})
    assert sum(bool(_printable_prefix(tok, _greedy_text(model, tok, q, 1))) for q in MC_QUESTIONS) >= 2

    refs = [tok.decode(_greedy_text(model, tok, p, MAX_GEN_TOKS)) for p in GEN_PROMPTS[:2]]
    until = [next(c for c in ref[1:] if c.isascii() and c.isprintable() and not c.isspace()) for ref in refs]
    target = min((refs[0].split(s)[0] for s in until), key=len)
    gen = [{"p": p, "t": target if i == 0 else "no such output"} for i, p in enumerate(GEN_PROMPTS)]

    letters = [{"q": f"Q{i}: pick", "gold": i % 4} for i in range(8)]  # few-shot, one-letter answers (MMLU-like)
    (d / "fewshot_train.jsonl").write_text(
        "".join(json.dumps({"q": f"E{i}: pick", "gold": i % 4}) + "\n" for i in range(3))
    )
    for name, rows in (("mc", mc), ("gen", gen), ("roll", [{"text": t} for t in ROLL_TEXTS]), ("fewshot", letters)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = d / "tasks"
    tasks.mkdir()
    _write_task(
        tasks / "mc.yaml",
        "acb_test_mc",
        d / "mc.jsonl",
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    )
    _write_task(
        tasks / "gen.yaml",
        "acb_test_gen",
        d / "gen.jsonl",
        'output_type: generate_until\ndoc_to_text: "{{p}}"\ndoc_to_target: "{{t}}"\n'
        f"generation_kwargs:\n  until: {json.dumps(until)}\n  max_gen_toks: {MAX_GEN_TOKS}\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    )
    (tasks / "fewshot.yaml").write_text(
        f"task: acb_test_fewshot\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    train: {d / 'fewshot_train.jsonl'}\n"
        f"    test: {d / 'fewshot.jsonl'}\ntest_split: test\nfewshot_split: train\nnum_fewshot: 3\n"
        "fewshot_config:\n  sampler: first_n\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}\\nAnswer:"\ndoc_to_choice: [" A", " B", " C", " D"]\ndoc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    _write_task(
        tasks / "roll.yaml",
        "acb_test_roll",
        d / "roll.jsonl",
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n",
    )
    return {"dir": d, "model": model, "tok": tok, "tasks": tasks}


@pytest.fixture(scope="module")
def task_manager(workdir):
    return TaskManager(include_path=str(workdir["tasks"]), include_defaults=False)


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        yield


def _evaluate(model, task_manager, model_args: str | None = None, tasks=TASKS, limit: int | None = None):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager,
        device="cpu",
        log_samples=True,
        limit=limit,
    )


@pytest.fixture(scope="module")
def hf_run(workdir, task_manager):
    return _evaluate("hf", task_manager, f"pretrained={workdir['dir'] / 'model'},max_length={MAX_LENGTH}")


@pytest.fixture(scope="module")
def acb_run(workdir, task_manager):
    """``model="acb"`` by name, in async-batching mode; also returns the engine cores it built."""
    cores: list[EngineCore] = []
    original = EngineCore.__init__

    def tracking_init(self, *a, **kw):
        original(self, *a, **kw)
        cores.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineCore, "__init__", tracking_init)
        results = _evaluate(
            "acb",
            task_manager,
            f"pretrained={workdir['dir'] / 'model'},max_length={MAX_LENGTH},use_async_batching=True",
        )
    return results, cores


def _same(a, b, where: str) -> None:
    """Equal structure: floats within 1e-4, everything else exactly."""
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, abs=1e-4), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _assert_same_metrics(ref: dict, got: dict, tasks=TASKS) -> None:
    for task in tasks:
        want, have = ref[task], got[task]
        assert want.keys() == have.keys()
        for key, value in want.items():
            if isinstance(value, float) and math.isfinite(value):
                assert have[key] == pytest.approx(value, rel=1e-5, abs=1e-9), f"{task} {key}"
            else:
                assert have[key] == value, f"{task} {key}"


def _assert_same_as_hf(hf: dict, got: dict, tasks=TASKS) -> None:
    for task in tasks:
        want = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
        have = sorted(got["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in want] == [s["doc_id"] for s in have] and want
        for s, t in zip(want, have):
            _same(s["resps"], t["resps"], f"{task} doc {s['doc_id']} resps")
            _same(s["filtered_resps"], t["filtered_resps"], f"{task} doc {s['doc_id']} filtered_resps")
    _assert_same_metrics(hf["results"], got["results"], tasks)


def test_the_tasks_exercise_what_they_should(hf_run):
    """Greedy flags of both kinds, a stop string hit (the generation target matched), truncation."""
    flags = [g for s in hf_run["samples"]["acb_test_mc"] for (_, g) in s["filtered_resps"]]
    assert any(flags) and not all(flags)
    assert hf_run["results"]["acb_test_gen"]["exact_match,none"] > 0
    assert max(len(q) for q in MC_QUESTIONS) > MAX_LENGTH and max(len(t) for t in ROLL_TEXTS) > 2 * MAX_LENGTH


def test_by_name_in_async_mode_matches_hf(hf_run, acb_run):
    _assert_same_as_hf(hf_run, acb_run[0])
    # the scoring requests read the prefix cache (contexts sharing a prefix: the few-shot preamble,
    # a question's choices, rolling windows' documents)
    assert acb_run[1][0].stats.prefix_hits > 0


def test_the_engine_stops_when_lm_eval_drops_the_model(acb_run):
    gc.collect()
    cores = acb_run[1]
    assert len(cores) == 1
    for core in cores:
        assert not core.is_running
        assert core.pool.num_used == 0 and not core.scheduler.live


def test_model_object_under_preemption_matches_hf(workdir, task_manager, hf_run):
    """A model object (not a path), a KV cache of 8 blocks of 8 tokens and prompts prefilled 16
    tokens a step: several prefills run side by side, and requests are preempted."""
    with AcbLM(
        workdir["model"],
        tokenizer=workdir["tok"],
        max_length=MAX_LENGTH,
        page_size=8,
        num_blocks=9,
        max_batch_tokens=16,
    ) as lm:
        assert lm.engine.config.max_model_len == 64
        got = _evaluate(lm, task_manager)
        assert lm.engine.stats.preemptions > 0
    assert not lm.engine.is_running
    _assert_same_as_hf(hf_run, got)


def test_on_the_own_cache_path_matches_hf(workdir, task_manager, hf_run):
    """The second runner path (the model on its own cache objects: what acb runs a model it
    cannot page on) gives lm-eval's hf backend's answers too."""
    with AcbLM(workdir["model"], tokenizer=workdir["tok"], max_length=MAX_LENGTH, runner="own_cache") as lm:
        assert lm.engine.runner.own_cache_runner is not None
        got = _evaluate(lm, task_manager)
    _assert_same_as_hf(hf_run, got)


# ------------------------------------------------------------------ a PEFT adapter (peft=)
PEFT_TASKS = ["acb_test_mc", "acb_test_gen", "acb_test_roll"]  # the three request types
PEFT_LIMIT = 3  # documents a task


@pytest.fixture(scope="module")
def adapter(workdir) -> Path:
    """A LoRA adapter of the tiny model, saved by PEFT (random: PEFT starts lora_B at zero, and
    such an adapter would change nothing)."""
    import peft

    torch.manual_seed(0)
    tuned = peft.get_peft_model(
        copy.deepcopy(workdir["model"]), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    path = workdir["dir"] / "adapter"
    tuned.save_pretrained(path)
    return path


def test_a_peft_adapter_matches_hf_with_it(workdir, task_manager, hf_run, adapter):
    """``--model_args pretrained=BASE,peft=ADAPTER``: acb's answers are hf's (a PeftModel) for
    every request type, and not the base model's (every request ran with the adapter)."""
    args = f"pretrained={workdir['dir'] / 'model'},peft={adapter},max_length={MAX_LENGTH}"
    hf = _evaluate("hf", task_manager, args, PEFT_TASKS, PEFT_LIMIT)
    got = _evaluate("acb", task_manager, args, PEFT_TASKS, PEFT_LIMIT)
    _assert_same_as_hf(hf, got, PEFT_TASKS)
    engine = got["config"]["acb_engine"]
    assert (engine["max_loras"], engine["max_lora_rank"]) == (1, 8)  # room for the one adapter, its rank
    assert got["config"]["peft"] == str(adapter)
    for task in PEFT_TASKS:
        base = {s["doc_id"]: s["resps"] for s in hf_run["samples"][task]}
        assert all(s["resps"] != base[s["doc_id"]] for s in got["samples"][task]), f"{task}: the base model's answers"


def test_peft_resizes_the_embeddings_as_hf(workdir, adapter, tmp_path):
    """hf resizes the model's embeddings to the tokenizer's length before it applies an adapter: a
    checkpoint whose vocabulary is padded past the tokenizer's then scores over fewer tokens.
    acb does the same, so the logprobs are hf's."""
    from lm_eval.models.huggingface import HFLM

    tok = workdir["tok"]
    padded = tiny_model("llama", vocab_size=len(tok) + 16, max_position_embeddings=256)
    padded.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reqs = [Instance("loglikelihood", {}, (c, x), 0) for c, x in (("Once upon a", " time"), ("abc", " def"))]
    hf = HFLM(pretrained=str(tmp_path), peft=str(adapter), device="cpu", max_length=MAX_LENGTH)
    want = hf.loglikelihood(reqs)
    with AcbLM(str(tmp_path), peft=str(adapter), max_length=MAX_LENGTH) as lm:
        assert lm.engine.model.config.vocab_size == len(tok)
        _same(want, lm.loglikelihood(reqs), "a vocabulary padded past the tokenizer's")


def test_peft_settings_and_refusals(workdir, adapter):
    """The model arguments' max_loras/max_lora_rank are kept; what cannot run is refused with why,
    and an engine already started for it is stopped."""
    kw = {"tokenizer": workdir["tok"], "max_length": MAX_LENGTH}
    with AcbLM(workdir["model"], peft=adapter, max_loras=2, max_lora_rank=16, **kw) as lm:
        assert (lm.engine.config.max_loras, lm.engine.config.max_lora_rank) == (2, 16)
        assert [i.name for i in lm.engine.list_loras()] == ["peft"]
        assert lm.get_model_info()["peft"] == str(adapter)
    threads = {t.name for t in threading.enumerate()}
    for extra, err, match in (
        ({"delta": str(adapter)}, ValueError, "both 'peft' and 'delta'"),
        ({"max_loras": 0}, ValueError, "max_loras=0 turns it off"),
        ({"max_lora_rank": 4}, ValueError, "rank"),  # given, so kept: the adapter's 8 is over it
        ({"runner": "own_cache"}, ValueError, "paged path only"),
    ):
        with pytest.raises(err, match=match):
            AcbLM(workdir["model"], peft=adapter, **extra, **kw)
    with pytest.raises(ValueError, match="delta weights"):
        AcbLM(workdir["model"], delta=str(adapter), **kw)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        AcbLM(workdir["model"], peft=workdir["dir"] / "model", **kw)  # a checkpoint, not an adapter
    with pytest.raises(ValueError, match="not a local folder"):
        AcbLM(workdir["model"], peft=str(workdir["dir"] / "no_such_adapter"), **kw)
    gc.collect()
    assert {t.name for t in threading.enumerate()} <= threads  # no engine thread left running


def test_cli(workdir, acb_run, tmp_path):
    """``python -m acb.integrations.lm_eval`` is lm-eval's command line with "acb" registered: the
    command the README and the evaluation guide show, with their flags, on a local task."""
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "acb.integrations.lm_eval",
        "--model",
        "acb",
        "--model_args",
        f"pretrained={workdir['dir'] / 'model'},max_length={MAX_LENGTH},use_async_batching=True",
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(workdir["tasks"]),
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
    ]
    # the pages' lm-eval lines (tests/test_docs_examples.py leaves them to this test): the same entry
    # point, and no flag this run does not use
    from tests.test_docs_examples import SHELL, commands

    lines = [a for b in SHELL for a in commands(b) if a[:3] == ["python", "-m", "acb.integrations.lm_eval"]]
    assert lines, "no page shows the lm-eval command"
    for argv in lines:
        flags = {a.split("=")[0] for a in argv if a.startswith("--")}
        assert flags <= set(cmd), f"{argv}: a flag this test does not run"
        assert argv[argv.index("--model") + 1] == "acb" and argv[argv.index("--model_args") + 1].startswith(
            "pretrained="
        )
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(path).read_text())
    assert results["config"]["model"] == "acb"
    _assert_same_metrics(acb_run[0]["results"], results["results"])


def test_refuses_what_it_cannot_honour(workdir):
    with pytest.raises(TypeError, match="num_blockz"):
        AcbLM(workdir["model"], tokenizer=workdir["tok"], num_blockz=4)
    with pytest.raises(ValueError, match="max_length=300"):
        AcbLM(workdir["model"], tokenizer=workdir["tok"], max_length=300)  # the model holds 256 positions
    with AcbLM(workdir["model"], tokenizer=workdir["tok"]) as lm:
        from lm_eval.models.huggingface import HFLM

        hf = HFLM(pretrained=workdir["model"], tokenizer=workdir["tok"], device="cpu")
        assert lm.max_length == hf.max_length == 256  # hf's window, the model's 256 positions (was 254)
        for kwargs, match in (
            ({"num_beams": 4, "max_gen_toks": 8}, "beam search"),
            ({"typical_p": 0.5, "max_gen_toks": 8}, "typical_p"),
            ({}, "no room"),
        ):
            req = Instance("generate_until", {}, ("Hello", {"until": ["\n"], **kwargs}), 0)
            with pytest.raises(ValueError, match=match):
                lm.generate_until([req])


def test_a_context_that_encodes_to_nothing_is_refused_as_hf_does(workdir):
    """A context of spaces alone: TemplateLM moves the spaces into the continuation and the
    context encodes to no tokens (the byte-level tokenizer adds no BOS). hf asserts on it; acb
    refuses it too, where it used to score the continuation without its first token. The empty
    context next to it gets the prefix token, with hf's numbers."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=workdir["model"], tokenizer=workdir["tok"], max_length=MAX_LENGTH, device="cpu")
    blank, empty = (Instance("loglikelihood", {}, (ctx, " yes no"), 0) for ctx in ("  ", ""))
    with pytest.raises(AssertionError):
        hf.loglikelihood([blank])
    with AcbLM(workdir["model"], tokenizer=workdir["tok"], max_length=MAX_LENGTH) as lm:
        with pytest.raises(ValueError, match="context '  ' encodes to no tokens"):
            lm.loglikelihood([empty, blank])
        assert lm.engine.stats.finished == 0  # refused before anything was submitted
        _same(hf.loglikelihood([empty]), lm.loglikelihood([empty]), "empty context")


def test_chat_template_falls_back_without_the_system_message(workdir):
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>"
        "{% endif %}"
    )
    with AcbLM(workdir["model"], tokenizer=tok) as lm:
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert lm.apply_chat_template(chat) == "<user>hi<assistant>"
        assert lm.apply_chat_template(chat[1:], add_generation_prompt=False) == "<user>hi"


def test_example_runs(tmp_path):
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lm_eval_acb.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = re.findall(r"^(acb_example_\w+)\s+(\w+)\s+([0-9.]+)$", p.stdout, re.M)
    assert {(task, metric) for task, metric, _ in rows} == {
        ("acb_example_mc", "acc"),
        ("acb_example_mc", "acc_norm"),
        ("acb_example_gen", "exact_match"),
    }
    assert all(0 <= float(v) <= 1 for _, _, v in rows)
