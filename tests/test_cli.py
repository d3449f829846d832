"""``acb generate`` (acb/cli.py): in-process runs on the embedded default model, small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acb.cli import DEFAULT_OUTPUT, main
from acb.models import build_tokenizer

# a small KV cache: the CPU default sizes one for 128 full-length requests (slow to allocate)
SMALL = ["--num-blocks", "64", "--block-size", "16", "--no-progress"]
KEYS = {"id", "prompt_len", "generated_ids", "text", "finish_reason", "status", "error"}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write_prompts(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_synthetic_prompts_default_output_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["generate", "--num-prompts", "4", "--max-new-tokens", "4", "--min-prompt-len", "5",
               "--max-prompt-len", "20", *SMALL])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out == ""  # results never go to stdout
    out = tmp_path / DEFAULT_OUTPUT
    rows = _read(out)
    assert len(rows) == 4
    for i, row in enumerate(rows):
        assert set(row) == KEYS
        assert row["id"] == f"req_{i}"
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


def test_greedy_is_deterministic_and_ignore_eos_fills(tmp_path):
    args = ["generate", "--num-prompts", "4", "--max-new-tokens", "4", "--max-prompt-len", "20",
            "--ignore-eos", *SMALL]
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


def test_prompts_file_text_and_ids_keeps_order_and_ids(tmp_path):
    tok = build_tokenizer()
    prompts = _write_prompts(tmp_path / "p.jsonl", [
        {"id": "alpha", "prompt": "hello world"},
        {"prompt_ids": [5, 6, 7, 8]},
        "",  # blank lines are skipped
        {"id": 42, "prompt": "x"},
        {"id": "last", "prompt_ids": [10, 11]},
    ])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--prompts", str(prompts), "--max-new-tokens", "3", "--ignore-eos",
                 "--output", str(out), *SMALL]) == 0
    rows = _read(out)
    assert [r["id"] for r in rows] == ["alpha", "req_1", 42, "last"]
    assert [r["prompt_len"] for r in rows] == [len(tok.encode("hello world")), 4, len(tok.encode("x")), 2]
    for r in rows:
        assert len(r["generated_ids"]) == 3
        assert r["text"] == tok.decode(r["generated_ids"], skip_special_tokens=True)

    # the same prompt as text and as ids generates the same tokens
    same = _write_prompts(tmp_path / "same.jsonl", [
        {"prompt": "hello world"}, {"prompt_ids": tok.encode("hello world")},
    ])
    out2 = tmp_path / "o2.jsonl"
    assert main(["generate", "--prompts", str(same), "--max-new-tokens", "3", "--ignore-eos",
                 "--output", str(out2), *SMALL]) == 0
    r2 = _read(out2)
    assert r2[0]["generated_ids"] == r2[1]["generated_ids"] == rows[0]["generated_ids"]


def test_per_line_max_new_tokens(tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", [
        {"prompt_ids": [5, 6, 7], "max_new_tokens": 1},
        {"prompt_ids": [8, 9, 10, 11], "max_new_tokens": 6},
        {"prompt_ids": [12, 13]},  # falls back to --max-new-tokens
        {"prompt": "abc", "max_new_tokens": 2},
    ])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--prompts", str(prompts), "--max-new-tokens", "4", "--ignore-eos",
                 "--output", str(out), *SMALL]) == 0
    rows = _read(out)
    assert [len(r["generated_ids"]) for r in rows] == [1, 6, 4, 2]
    assert [r["id"] for r in rows] == ["req_0", "req_1", "req_2", "req_3"]
    assert all(r["status"] == "FINISHED" and r["finish_reason"] == "length" for r in rows)

    # the per-request path and the generate_batch path agree on greedy tokens
    uniform = _write_prompts(tmp_path / "u.jsonl", [{"prompt_ids": [8, 9, 10, 11]}])
    out_u = tmp_path / "u_out.jsonl"
    assert main(["generate", "--prompts", str(uniform), "--max-new-tokens", "6", "--ignore-eos",
                 "--output", str(out_u), *SMALL]) == 0
    assert _read(out_u)[0]["generated_ids"] == rows[1]["generated_ids"]


def test_local_checkpoint(tmp_path):
    from acb.models import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("qwen3", vocab_size=259).save_pretrained(ckpt)
    build_tokenizer().save_pretrained(ckpt)
    prompts = _write_prompts(tmp_path / "p.jsonl", [{"prompt": "hi there"}, {"prompt_ids": [7, 8, 9]}])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "3",
                 "--ignore-eos", "--output", str(out), *SMALL]) == 0
    rows = _read(out)
    assert [r["prompt_len"] for r in rows] == [8, 3]
    assert [len(r["generated_ids"]) for r in rows] == [3, 3]


def test_prompt_that_can_never_fit_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--num-prompts", "2", "--min-prompt-len", "40", "--max-prompt-len", "40",
              "--num-blocks", "2", "--block-size", "16", "--no-progress", "--output", str(tmp_path / "o.jsonl")])
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
        ([{"prompt_ids": [5, 100000]}], "vocabulary"),
    ],
)
def test_bad_prompts_file_exits_2(tmp_path, capsys, rows, needle):
    prompts = _write_prompts(tmp_path / "p.jsonl", rows)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), *SMALL])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
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


def test_python_dash_m(tmp_path):
    out = tmp_path / "o.jsonl"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "acb", "generate", "--num-prompts", "2", "--max-new-tokens", "2",
         "--no-progress", "--output", str(out), "--num-blocks", "64", "--block-size", "16"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    rows = _read(out)
    assert len(rows) == 2
    assert all(1 <= len(r["generated_ids"]) <= 2 for r in rows)
    assert "2 requests" in proc.stderr


def test_sampling_flags_and_samples(tmp_path):
    out = tmp_path / "s.jsonl"
    rc = main(["generate", "--num-prompts", "2", "--max-new-tokens", "3", "--min-prompt-len", "4", "--max-prompt-len", "12",
                   "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "-n", "3", "--logprobs", "2",
                   "--ignore-eos", "--num-blocks", "64", "--block-size", "16", "--no-progress", "--output", str(out)])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2
    for rec in lines:
        assert len(rec["samples"]) == 3 and all(len(s["generated_ids"]) == 3 for s in rec["samples"])
        assert len(rec["top_logprobs"]) == 3 and all(len(t) == 2 for t in rec["top_logprobs"])
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--num-prompts", "1", "--top-p", "0", "--output", str(out)])
    assert ei.value.code == 2
