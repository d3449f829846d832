"""``acb generate`` (acb/cli/generate.py): in-process runs on the embedded default model, small sizes,
and two subprocess runs (``-o -`` on stdout; Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acb.cli import DEFAULT_OUTPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, main
from acb.models import build_tokenizer

# a small KV cache: the CPU default sizes one for 128 full-length requests (slow to allocate)
SMALL = ["--num-blocks", "64", "--page-size", "16", "--no-progress"]
KEYS = {"index", "id", "prompt_len", "generated_ids", "text", "finish_reason", "status", "error"}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write_prompts(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _cli(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    """``python -m acb ARGS`` in a subprocess, on this checkout."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "acb", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def _summary(err: str) -> tuple[int, float, float]:
    """(generated tokens, generation time, tokens/s) as the summary prints them."""
    gen = int(re.search(r"generated tokens:\s+(\d+)", err).group(1))
    secs = float(re.search(r"generation time:\s+([\d.]+) s", err).group(1))
    rate = float(re.search(r"throughput:\s+([\d.]+) generated tokens/s", err).group(1))
    return gen, secs, rate


def _check_rate(rows: list[dict], err: str) -> float:
    """The summary's tokens/s is the output's generated tokens over its generation time, to rounding."""
    gen, secs, rate = _summary(err)
    assert gen == sum(len(r["generated_ids"]) for r in rows) > 0
    assert secs > 0
    # time printed to 1 ms and the rate to 0.1 token/s: the exact rate lies within that rounding
    lo, hi = gen / (secs + 0.0005) - 0.05, gen / max(secs - 0.0005, 1e-9) + 0.05
    assert lo <= rate <= hi, (gen, secs, rate)
    return rate


def test_synthetic_prompts_default_output_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(
        [
            "generate",
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "4",
            "--min-prompt-len",
            "5",
            "--max-prompt-len",
            "20",
            *SMALL,
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out == ""  # results never go to stdout
    out = tmp_path / DEFAULT_OUTPUT
    rows = _read(out)
    assert len(rows) == 4
    for i, row in enumerate(rows):
        assert set(row) == KEYS
        assert row["id"] == f"req_{i}" and row["index"] == i
        assert 5 <= row["prompt_len"] <= 20
        assert 1 <= len(row["generated_ids"]) <= 4
        assert all(isinstance(t, int) for t in row["generated_ids"])
        assert isinstance(row["text"], str)
        assert row["status"] == "FINISHED"
        assert row["finish_reason"] in ("stop", "length")
        assert row["error"] is None
    gen = sum(len(r["generated_ids"]) for r in rows)
    prompt = sum(r["prompt_len"] for r in rows)
    err = captured.err
    assert "4 requests" in err
    assert f"prompt tokens:     {prompt}" in err
    assert f"generated tokens:  {gen}" in err
    assert "tokens/s" in err and "requests/s" in err
    assert str(out) in err
    # said when the file is opened, not only in --help and the summary (issue 37)
    assert f"acb generate: writing results to {out} (no -o given" in err.splitlines()[0]
    _check_rate(rows, err)


def test_greedy_is_deterministic_and_ignore_eos_fills(tmp_path):
    args = ["generate", "--num-prompts", "4", "--max-new-tokens", "4", "--max-prompt-len", "20", "--ignore-eos", *SMALL]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main([*args, "--output", str(a)]) == 0
    assert main([*args, "--output", str(b), "--max-requests-per-batch", "2", "--max-batch-tokens", "32"]) == 0
    assert a.read_text() == b.read_text()
    rows = _read(a)
    assert [len(r["generated_ids"]) for r in rows] == [4] * 4
    assert {r["finish_reason"] for r in rows} == {"length"}
    # a different seed gives different synthetic prompts
    c = tmp_path / "c.jsonl"
    assert main([*args, "--output", str(c), "--seed", "1"]) == 0
    assert c.read_text() != a.read_text()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_engine_flags_reach_the_config(command):
    from acb.cli import build_parser, engine_config

    flags = [
        "--async-batching",
        "--no-cuda-graphs",
        "--no-prefix-caching",
        "--cpu-offload-space",
        "0.5",
        "--attn-backend",
        "torch",
        "--scheduler",
        "prefill_first",
        "--max-model-len",
        "300",
        "--page-size",
        "8",
        "--cpu-packed-linears",
    ]
    cfg = engine_config(build_parser().parse_args([command, *flags]))
    assert (
        cfg.use_async_batching,
        cfg.use_cuda_graph,
        cfg.allow_block_sharing,
        cfg.cpu_offload_space,
        cfg.attn_backend,
        cfg.scheduler_type,
        cfg.max_model_len,
        cfg.page_size,
        cfg.cpu_packed_linears,
    ) == (True, False, False, 0.5, "torch", "prefill_first", 300, 8, True)
    default = engine_config(build_parser().parse_args([command]))
    assert (
        default.use_async_batching,
        default.use_cuda_graph,
        default.allow_block_sharing,
        default.cpu_offload_space,
        default.cpu_packed_linears,
    ) == (None, None, True, 0.0, None)  # the engine's own defaults
    off = engine_config(build_parser().parse_args([command, "--no-cpu-packed-linears"]))
    assert off.cpu_packed_linears is False


def test_async_batching_and_offload_flags_keep_greedy_output(tmp_path, capsys):
    """The same greedy output with async batching on and a cache small enough to preempt and offload
    (the summary says how often it did)."""
    args = [
        "generate",
        "--num-prompts",
        "6",
        "--max-new-tokens",
        "12",
        "--min-prompt-len",
        "20",
        "--max-prompt-len",
        "40",
        "--ignore-eos",
        "--no-progress",
        "--page-size",
        "16",
    ]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main([*args, "--num-blocks", "64", "--output", str(a)]) == 0
    assert (
        main([*args, "--num-blocks", "9", "--async-batching", "--cpu-offload-space", "0.01", "--output", str(b)]) == 0
    )
    assert a.read_text() == b.read_text()
    line = next(x for x in capsys.readouterr().err.splitlines()[::-1] if x.strip().startswith("engine:"))
    m = re.search(r"(\d+) preemptions \((\d+) KV blocks offloaded to host memory, (\d+) recomputed\)", line)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, line


def test_prompts_file_text_and_ids_keeps_order_and_ids(tmp_path):
    tok = build_tokenizer()
    prompts = _write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "alpha", "prompt": "hello world"},
            {"prompt_ids": [5, 6, 7, 8]},
            "",  # blank lines are skipped
            {"id": 42, "prompt": "x"},
            {"id": "last", "prompt_ids": [10, 11]},
        ],
    )
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "3",
                "--ignore-eos",
                "--output",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    rows = _read(out)
    assert [r["id"] for r in rows] == ["alpha", "req_1", 42, "last"]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["prompt_len"] for r in rows] == [len(tok.encode("hello world")), 4, len(tok.encode("x")), 2]
    for r in rows:
        assert len(r["generated_ids"]) == 3
        assert r["text"] == tok.decode(r["generated_ids"], skip_special_tokens=True)

    # the same prompt as text and as ids generates the same tokens
    same = _write_prompts(
        tmp_path / "same.jsonl",
        [
            {"prompt": "hello world"},
            {"prompt_ids": tok.encode("hello world")},
        ],
    )
    out2 = tmp_path / "o2.jsonl"
    assert (
        main(
            ["generate", "--prompts", str(same), "--max-new-tokens", "3", "--ignore-eos", "--output", str(out2), *SMALL]
        )
        == 0
    )
    r2 = _read(out2)
    assert r2[0]["generated_ids"] == r2[1]["generated_ids"] == rows[0]["generated_ids"]


def test_per_line_max_new_tokens(tmp_path):
    prompts = _write_prompts(
        tmp_path / "p.jsonl",
        [
            {"prompt_ids": [5, 6, 7], "max_new_tokens": 1},
            {"prompt_ids": [8, 9, 10, 11], "max_new_tokens": 6},
            {"prompt_ids": [12, 13]},  # falls back to --max-new-tokens
            {"prompt": "abc", "max_new_tokens": 2},
        ],
    )
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "4",
                "--ignore-eos",
                "--output",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    rows = _read(out)
    assert [len(r["generated_ids"]) for r in rows] == [1, 6, 4, 2]
    assert [r["id"] for r in rows] == ["req_0", "req_1", "req_2", "req_3"]
    assert all(r["status"] == "FINISHED" and r["finish_reason"] == "length" for r in rows)

    # the per-request path and the generate_batch path agree on greedy tokens
    uniform = _write_prompts(tmp_path / "u.jsonl", [{"prompt_ids": [8, 9, 10, 11]}])
    out_u = tmp_path / "u_out.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts",
                str(uniform),
                "--max-new-tokens",
                "6",
                "--ignore-eos",
                "--output",
                str(out_u),
                *SMALL,
            ]
        )
        == 0
    )
    assert _read(out_u)[0]["generated_ids"] == rows[1]["generated_ids"]


def test_chat_messages_use_the_chat_template(tmp_path):
    from acb.text import encode_prompt

    tok = build_tokenizer()  # the CLI's embedded tokenizer, with its own chat template
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = "system: be brief\nuser: hi\nassistant: "
    prompts = _write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "chat", "messages": chat},
            {"prompt": rendered},  # the same text, as a plain prompt
            {"messages": chat, "chat_template_kwargs": {"add_generation_prompt": False}},
            {"prompt_ids": [5, 6, 7]},
        ],
    )
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "3",
                "--ignore-eos",
                "--output",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    rows = _read(out)
    assert [r["id"] for r in rows] == ["chat", "req_1", "req_2", "req_3"]
    assert rows[0]["prompt_len"] == len(encode_prompt(tok, chat)) == len(tok.encode(rendered))
    assert rows[0]["generated_ids"] == rows[1]["generated_ids"]
    assert rows[2]["prompt_len"] == len(tok.encode(rendered)) - len("assistant: ")
    assert all(r["status"] == "FINISHED" and len(r["generated_ids"]) == 3 for r in rows)


def test_local_checkpoint(tmp_path, capsys):
    from acb.models import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("qwen3", vocab_size=259).save_pretrained(ckpt)
    tok = build_tokenizer()
    tok.chat_template = None  # a checkpoint whose tokenizer has no chat template (see below)
    tok.save_pretrained(ckpt)
    prompts = _write_prompts(tmp_path / "p.jsonl", [{"prompt": "hi there"}, {"prompt_ids": [7, 8, 9]}])
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "generate",
                "--model",
                str(ckpt),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "3",
                "--ignore-eos",
                "--output",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    rows = _read(out)
    assert [r["prompt_len"] for r in rows] == [8, 3]
    assert [len(r["generated_ids"]) for r in rows] == [3, 3]

    # this checkpoint's tokenizer has no chat template: a chat line is refused, naming its line
    chat = _write_prompts(tmp_path / "chat.jsonl", [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(ckpt), "--prompts", str(chat), "--output", str(tmp_path / "c.jsonl"), *SMALL])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:2" in err and "chat template" in err
    assert not (tmp_path / "c.jsonl").exists()


def test_prompt_that_can_never_fit_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "generate",
                "--num-prompts",
                "2",
                "--min-prompt-len",
                "40",
                "--max-prompt-len",
                "40",
                "--num-blocks",
                "2",
                "--page-size",
                "16",
                "--no-progress",
                "--output",
                str(tmp_path / "o.jsonl"),
            ]
        )
    assert exc.value.code == 2
    assert "can never fit" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"prompt_ids": [5, 6]}, "{not json"], "p.jsonl:2"),
        ([{"prompt_ids": [5, 6]}, {"prompt_ids": [7]}, {"id": "x"}], "p.jsonl:3"),
        (["[1, 2, 3]"], "p.jsonl:1"),
        ([{"prompt_ids": [5, "a"]}], "p.jsonl:1"),
        ([{"prompt_ids": []}], "p.jsonl:1"),
        ([{"prompt": "a", "prompt_ids": [5]}], "p.jsonl:1"),
        ([{"prompt_ids": [5], "max_new_tokens": 0}], "p.jsonl:1"),
        # the engine's checks name the line too (a blank line: line 3 is the second prompt)
        (
            [{"prompt_ids": [5]}, "", {"prompt_ids": [5, 100000]}],
            "p.jsonl:3: token id 100000 is outside the model's vocabulary",
        ),
        (
            [{"prompt_ids": [5]}, "", {"id": "big", "prompt_ids": [5] * 4000}],
            "p.jsonl:3: prompt of 4000 tokens can never fit",
        ),
        ([{"messages": "hello"}], "p.jsonl:1"),
        ([{"messages": []}], "p.jsonl:1"),
        ([{"messages": [{"role": "user"}]}], "p.jsonl:1"),
        ([{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}], "p.jsonl:1"),
        ([{"prompt": "a", "chat_template_kwargs": {}}], "p.jsonl:1"),
        ([{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": [1]}], "p.jsonl:1"),
    ],
)
def test_bad_prompts_file_exits_2(tmp_path, capsys, rows, needle):
    prompts = _write_prompts(tmp_path / "p.jsonl", rows)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), *SMALL])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    # the one useful line, not the usage text before it (issue 37); nothing is said about an output
    assert err.startswith("acb generate: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--prompts", "does/not/exist.jsonl"], "no such file"),
        (["--model", "does/not/exist"], "--model"),
        (["--min-prompt-len", "30", "--max-prompt-len", "20"], "--min-prompt-len"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--output", "no/such/dir/o.jsonl"], "--output"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv, *SMALL])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "generate" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "meaningless" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_stdout_output_is_pure_jsonl_and_rates_agree(tmp_path):
    """``python -m acb generate -o -``: stdout holds only result lines, while the progress bar and
    the summary (on stderr) report the same generated tokens/s, which matches the output."""
    proc = _cli(
        [
            "generate",
            "--num-prompts",
            "6",
            "--max-new-tokens",
            "5",
            "--max-prompt-len",
            "20",
            "--ignore-eos",
            "--num-blocks",
            "64",
            "--page-size",
            "16",
            "-o",
            "-",
        ],
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in out.splitlines()]  # every stdout line is a JSON result
    assert [r["index"] for r in rows] == list(range(6))
    assert all(set(r) == KEYS and len(r["generated_ids"]) == 5 for r in rows)
    assert "6 requests: 6 finished, 0 failed" in err and "results written to stdout" in err
    assert not list(tmp_path.iterdir())  # no output file
    rate = _check_rate(rows, err)
    # the bar is labelled for the CLI, and its last tokens/s is the summary's
    bar = [seg for seg in re.split(r"[\r\n]", err) if seg.startswith("acb generate:") and "tok/s" in seg]
    assert bar, err
    assert float(re.search(r"([\d,.]+) generated tok/s", bar[-1]).group(1).replace(",", "")) == pytest.approx(rate)


def test_ctrl_c_writes_finished_results_and_exits_130(tmp_path):
    """SIGINT mid-run: exit 130, no traceback, the output holds only whole lines of finished
    results (input order), and the summary's finished/lost counts match it."""
    # even lines end after 3 tokens; odd ones would run for 2,000 (seconds on CPU)
    prompts = _write_prompts(
        tmp_path / "p.jsonl", [{"prompt": f"prompt {i}", "max_new_tokens": 3 if i % 2 == 0 else 2000} for i in range(8)]
    )
    out = tmp_path / "o.jsonl"
    proc = _cli(
        [
            "generate",
            "--prompts",
            str(prompts),
            "--ignore-eos",
            "--num-blocks",
            "600",
            "--page-size",
            "16",
            "-o",
            str(out),
        ],
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 90
        while not (out.exists() and out.read_text(encoding="utf-8").count("\n") >= 1):  # a result is out
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no result within 90 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err
    text = out.read_text(encoding="utf-8")
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows and all(r["status"] == "FINISHED" for r in rows)
    assert all(len(r["generated_ids"]) == 3 for r in rows)  # none of the long ones got to finish
    assert [r["index"] for r in rows] == sorted(r["index"] for r in rows)  # input order
    assert {r["index"] % 2 for r in rows} == {0}
    m = re.search(r"interrupted: 8 requests: (\d+) finished and (\d+) failed \(written\), (\d+) lost", err)
    assert m, err
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (len(rows), 0, 8 - len(rows))
    _check_rate(rows, err)


def test_reader_leaving_stdout_stops_quietly(tmp_path):
    """``acb generate -o - | head -1``: when the reader closes the pipe, the CLI stops with 141
    (as a shell reports SIGPIPE) and one line on stderr, not a traceback. (--block-size is the older
    spelling of --page-size.)"""
    proc = _cli(
        [
            "generate",
            "--num-prompts",
            "40",
            "--max-new-tokens",
            "64",
            "--ignore-eos",
            "--num-blocks",
            "256",
            "--block-size",
            "16",
            "-o",
            "-",
        ],
        cwd=tmp_path,
    )
    try:
        first = proc.stdout.readline()
        assert json.loads(first)["index"] == 0
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_BROKEN_PIPE, err
    assert "Traceback" not in err and "output pipe was closed" in err


def test_generate_batch_bar_is_labelled_for_the_library(capsys):
    import acb
    from acb.models import tiny_model

    cfg = acb.ContinuousBatchingConfig(num_blocks=16)
    out = acb.generate_batch(
        tiny_model(), [[5, 6, 7], [8, 9]], continuous_batching_config=cfg, max_new_tokens=2, progress_bar=True
    )
    assert len(out) == 2
    err = capsys.readouterr().err
    assert "generate_batch:" in err and "tok/s" in err
    assert "acb generate" not in err


def test_sampling_flags_and_samples(tmp_path):
    out = tmp_path / "s.jsonl"
    rc = main(
        [
            "generate",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "3",
            "--min-prompt-len",
            "4",
            "--max-prompt-len",
            "12",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "-n",
            "3",
            "--logprobs",
            "2",
            "--ignore-eos",
            "--num-blocks",
            "64",
            "--page-size",
            "16",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2
    for rec in lines:
        assert len(rec["samples"]) == 3 and all(len(s["generated_ids"]) == 3 for s in rec["samples"])
        assert len(rec["top_logprobs"]) == 3 and all(len(t) == 2 for t in rec["top_logprobs"])
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--num-prompts", "1", "--top-p", "0", "--output", str(out)])
    assert ei.value.code == 2


def test_serve_help_names_every_route(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics"):
        assert route in out, route


def test_weight_updates_with_ray_need_a_fixed_replica_count(capsys):
    """A trainer's group has one rank per replica: autoscaling is refused, saying what to do (the
    config file's builder too)."""
    from acb.cli.serve import build_ray_application

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--ray", "--enable-weight-updates", "--min-replicas", "1", "--max-replicas", "3"])
    assert exc.value.code == 2
    assert "--enable-weight-updates needs a fixed replica count" in capsys.readouterr().err
    pytest.importorskip("ray.serve")
    with pytest.raises(ValueError, match="fixed replica count"):
        build_ray_application({"argv": "--enable-weight-updates", "min_replicas": 1, "max_replicas": 2})
