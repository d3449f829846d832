"""The README's and docs/'s code works as a newcomer would use it, word for word.

- **Python blocks** run page by page, in order, in one namespace per page that starts empty: a
  page defines what it uses (its model, prompts...) or the block fails, as it would for a reader
  who copies it. Before running, every name a block reads must be a builtin, bound by the block,
  or bound by an earlier block of the page (an AST check, so that compile-only blocks are held to
  it too). Blocks marked ``<!-- docs-test: compile only (why; given: NAME, ...) -->`` (a GPU, a
  cluster, a server, a download) are compiled and name-checked, not run; ``given:`` lists the
  names the reader supplies. Top-level ``await`` is allowed (a notebook cell's).
- **Shell blocks** are split into commands. ``acb generate`` lines run, as written, on the
  embedded tiny model saved as a local checkpoint (``PATH``, ``./my-checkpoint``); ``python -m
  acb.integrations.lm_eval`` lines are run by ``tests/integrations/test_lm_eval.py::test_cli``
  (every flag they use, on a tiny local task: no downloads); other ``acb`` commands are parsed by
  acb's own argument parser; install lines are checked by ``tests/test_docs.py``; a command
  nobody classified fails the test.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARK = "<!-- docs-test: compile only"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first line of code
    lang: str
    source: str
    marker: str | None  # the compile-only comment before the fence, if any

    @property
    def given(self) -> set[str]:
        m = re.search(r"given: ([^)]*)\)", self.marker or "")
        return {n.strip() for n in m.group(1).split(",")} if m else set()

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, j = len(m.group(1)), i + 1
        while not lines[j].strip().startswith("```"):
            j += 1
        before = lines[i - 1].strip() if i else ""
        found.append(
            Block(
                path,
                i + 2,
                m.group(2),
                "\n".join(ln[indent:] for ln in lines[i + 1 : j]),
                before if before.startswith(MARK) else None,
            )
        )
        i = j + 1
    return found


PY_PAGES = [p for p in PAGES if any(b.lang == "python" for b in blocks(p))]
SHELL = [b for p in PAGES for b in blocks(p) if b.lang in ("bash", "sh", "shell", "console")]


def bound_and_read(source: str) -> tuple[set[str], list[tuple[str, int]]]:
    """The names a block binds (anywhere in it) and the names it reads, with their lines. Scopes are
    flattened: good enough to catch a name that nothing on the page defines."""
    tree = ast.parse(source)
    bound: set[str] = set()
    read: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound.add(node.id) if isinstance(node.ctx, (ast.Store, ast.Del)) else read.append((node.id, node.lineno)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, ast.MatchAs) and node.name:
            bound.add(node.name)
    return bound, read


def undefined(block: Block, known: set[str]) -> list[str]:
    bound, read = bound_and_read(block.source)
    ok = known | bound | block.given | set(dir(builtins))
    return sorted({f"{name} (line {block.line + line - 1})" for name, line in read if name not in ok})


def test_the_name_check_catches_an_undefined_model():
    """The check that each page defines its names bites (the guides once used an undefined
    ``model``)."""
    b = Block(ROOT / "README.md", 10, "python", "import acb\nwith acb.Engine(model) as e:\n    e.generate([1])", None)
    assert undefined(b, set()) == ["model (line 11)"]
    assert undefined(b, {"model"}) == []
    assert (
        undefined(Block(b.path, 1, "python", "out = engine.generate(prompt)", f"{MARK} (x; given: engine)"), {"prompt"})
        == []
    )


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Pages write files (a checkpoint folder, say) where the reader stands: a fresh folder."""
    monkeypatch.chdir(tmp_path)
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    return tmp_path


@pytest.mark.parametrize("page", PY_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_order_in_the_page_namespace(page: Path, in_tmp) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    known: set[str] = set()
    try:
        for block in (b for b in blocks(page) if b.lang == "python"):
            code = compile(block.source, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            missing = undefined(block, known)
            assert not missing, f"{block}: names the page never defines: {missing}"
            known |= bound_and_read(block.source)[0]
            if block.marker is not None:
                continue  # compiled and name-checked: its syntax and its names hold
            result = eval(code, namespace)  # noqa: S307 - the documentation's own code
            if asyncio.iscoroutine(result):  # top-level await: a notebook cell's
                asyncio.run(result)
    finally:
        import acb

        for value in list(namespace.values()):  # an engine a page started without a with block
            if isinstance(value, acb.Engine) and value.is_running:
                value.shutdown()
            elif isinstance(value, acb.AsyncEngine) and value.is_running:
                asyncio.run(value.shutdown())


def test_every_block_is_found_and_most_run():
    py = [b for p in PAGES for b in blocks(p) if b.lang == "python"]
    assert len(py) >= 15 and sum(b.marker is None for b in py) >= 12
    assert len(SHELL) >= 10


# ---------------------------------------------------------------------------- shell blocks


def commands(block: Block) -> list[list[str]]:
    """The block's simple commands, as argv lists: continuation lines joined, comments dropped,
    ``&&`` chains split."""
    text = block.source.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|>")
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        for tok in lex:
            if tok in ("&&", ";", "||", "|"):
                out.append(argv)
                argv = []
            else:
                argv.append(tok)
        if argv:
            out.append(argv)
    return [a for a in out if a]


# commands a shell block may hold that this test does not run: (first words, why)
CHECKED_ELSEWHERE = {
    ("python3", "-m", "venv"): "makes the virtual environment a fresh clone's commands run in",
    (".",): "activates it",
    ("pip", "install"): "install lines: tests/test_docs.py checks their distribution name and extras",
    ("ruff",): "the README's test command: CI runs it (.ci/run)",
    ("mypy",): "the README's test command: CI runs it (.ci/run)",
    ("python", "-m", "pytest"): "the README's test command: CI runs it (.ci/run)",
    ("mkdocs", "serve"): "tests/test_docs.py builds the site",
    ("curl",): "a running acb serve (tests/serve drive every endpoint)",
    ("python", "benchmarks/gpu_check.py"): "a GPU",
    ("python", "-m", "acb.integrations.lm_eval"): (
        "tests/integrations/test_lm_eval.py::test_cli runs this entry point with every flag the pages' lm-eval "
        "lines use (it reads them from the pages) and checks its metrics against the in-process run"
    ),
}


def _checkpoint(tmp: Path) -> dict[str, str]:
    """The embedded model saved as a checkpoint folder."""
    from acb.models import build_tokenizer, default_model

    ckpt = tmp / "ckpt"
    default_model().save_pretrained(ckpt)
    build_tokenizer().save_pretrained(ckpt)
    return {"ckpt": str(ckpt)}


def _substitute(argv: list[str], where: dict[str, str]) -> list[str]:
    """A reader's placeholders made real: the checkpoint, the task, the CPU."""
    out = []
    for i, a in enumerate(argv):
        a = re.sub(r"(?<![\w/])(PATH|\./my-checkpoint|/shared/my-model)(?![\w/])", where["ckpt"], a)
        if a == "cuda" and i and argv[i - 1] == "--device":
            a = "cpu"
        out.append(a)
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OFFLINE)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # the `acb` script
    return env


def _parse_acb(argv: list[str]) -> None:
    from acb.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"acb {' '.join(argv)}: acb's parser refuses it") from exc


def _run(cmd: list[str] | str, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600, shell=isinstance(cmd, str)
    )
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stderr[-3000:]}"
    return p


# a command's run, by its words: the same `acb generate` line on several pages (the README's two
# commands are getting-started's) runs once
_RUNS: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def _run_once(argv: list[str], cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    key = tuple(argv)
    if key not in _RUNS:
        _RUNS[key] = _run(cmd, cwd)
    return _RUNS[key]


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_shell_commands_run_or_parse_as_written(block: Block, tmp_path: Path) -> None:
    where: dict[str, str] | None = None
    for argv in commands(block):
        if any(tuple(argv[: len(k)]) == k for k in CHECKED_ELSEWHERE):
            continue
        if argv[0] == "torchrun":  # a tensor-parallel run needs several processes: its acb part is parsed
            assert "-m" in argv and argv[argv.index("-m") + 1] == "acb", argv
            argv = ["acb", *argv[argv.index("-m") + 2 :]]
        if argv[0] == "printf" or argv[:1] == ["echo"]:  # makes an input file the next command reads
            _run(shlex.join(argv).replace("'>'", ">"), tmp_path)
            continue
        where = where or _checkpoint(tmp_path)
        if argv[:2] == ["acb", "generate"] and "torchrun" not in block.source:
            p = _run_once(argv, _substitute(argv, where), tmp_path)
            assert "requests:" in p.stderr and " 0 failed" in p.stderr, p.stderr[-2000:]
        elif argv[0] == "acb":
            _parse_acb(_substitute(argv, where)[1:])
        else:
            pytest.fail(f"{block}: a command this test does not know how to check: {shlex.join(argv)}")


def test_the_readme_shows_a_command_that_finds_acb_in_lm_eval():
    """lm-eval's own ``lm_eval --model acb`` cannot find acb (lm-eval reads no plug-ins for
    models), so no page may show it; ``python -m acb.integrations.lm_eval`` is the command."""
    for page in PAGES:
        text = page.read_text()
        bad = [m.group(0) for m in re.finditer(r"(?<![\w.])lm_eval --model acb[^\n`]*", text)]
        assert not bad, f"{page.relative_to(ROOT)}: {bad}"
    assert any(
        argv[:4] == ["python", "-m", "acb.integrations.lm_eval", "--model"]
        for b in SHELL
        if b.path.name == "README.md"
        for argv in commands(b)
    )
