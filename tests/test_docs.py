"""The documentation (docs/, mkdocs.yml): the site builds in strict mode (a broken link, anchor
or API reference fails it), the generated configuration page matches the code, and every
public name has a reference entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_configuration_page_is_current():
    p = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_config.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr


def test_every_public_name_has_a_reference_entry():
    import acb

    reference = (ROOT / "docs" / "reference.md").read_text()
    missing = [n for n in acb.__all__ if f"::: acb.{n}\n" not in reference]
    assert not missing, f"docs/reference.md lacks {missing}"


def test_the_readme_is_a_landing_page_whose_links_exist():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / target).exists(), target


def test_the_benchmark_tables_are_current(tmp_path):
    """benchmarks/RESULTS.md's generated blocks are what ``acb bench report`` makes of the
    committed results (benchmarks/results/*.json)."""
    import shutil

    copy = tmp_path / "RESULTS.md"
    shutil.copy(ROOT / "benchmarks" / "RESULTS.md", copy)
    p = subprocess.run(
        [sys.executable, "-m", "acb", "bench", "report", "--update-readme", str(copy), "--no-plot"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert copy.read_text() == (ROOT / "benchmarks" / "RESULTS.md").read_text(), (
        "benchmarks/RESULTS.md is stale: run acb bench report --update-readme benchmarks/RESULTS.md"
    )


def test_every_public_method_documents_its_arguments():
    """One docstring style (Google's): every public function and method of ``acb.__all__`` that
    takes arguments has an ``Args:`` section (the API reference renders it as a table)."""
    import inspect

    import acb

    missing = []
    for name in acb.__all__:
        obj = getattr(acb, name)
        members = (
            [(name, obj)]
            if inspect.isfunction(obj)
            else [
                (f"{name}.{m}", f)
                for m, f in inspect.getmembers(obj)
                if inspect.isclass(obj)
                and not m.startswith("_")
                and inspect.isfunction(f)
                and f.__module__.startswith("acb.")
            ]
        )
        for qual, f in members:
            params = [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]
            if params and "Args:" not in (inspect.getdoc(f) or ""):
                missing.append(qual)
    assert not missing, f"no Args: section: {missing}"


# ------------------------------------------------------------------ install lines (issue 37)


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _install_lines() -> list[tuple[str, str]]:
    """Every ``pip install ...`` a user can read: the README, docs/, examples/ and acb/'s own
    messages and docstrings, as (where, the words after ``pip install``)."""
    files = [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "examples").glob("*.py"),
        *(ROOT / "acb").rglob("*.py"),
    ]
    return [found for f in files for found in _install_lines_of(f.read_text(), str(f.relative_to(ROOT)))]


def _install_lines_of(text: str, where: str) -> list[tuple[str, str]]:
    """The install lines of one file's ``text``, as (``where:line``, the words)."""
    import re

    lines = text.splitlines()
    found = []
    # a line may break right after "pip install" (a docstring, a comment): the words are then on
    # the next line, after its indent and any comment or quote marker
    for m in re.finditer(r"pip install[ \t]*(?:\n[ \t]*(?:[#>][ \t]*)?)?((?:-e\s+)?[^`#&()\n]*)", text):
        n = text.count("\n", 0, m.start()) + 1
        if re.search(r"unrelated|something else|[Oo]nce published", " ".join(lines[n - 1 : n + 1])):
            continue  # the sentence that says what `pip install acb` and the published name are
        found.append((f"{where}:{n}", m.group(1).strip()))
    return found


def _acb_specs(words: str) -> list[str]:
    """The requirement specs of ``words`` that name acb: ``.`` / ``.[x]`` (a checkout) or a
    distribution called acb-something."""
    import re

    specs = [w.strip("'\"") for w in words.split()]
    return [s for s in specs if re.fullmatch(r"\.(\[.*\])?|acb([-_][\w-]+)?(\[.*\])?", s)]


def check_install_line(where: str, words: str, extras: set[str]) -> list[str]:
    """What is wrong with one install line: a distribution other than acb-batching, an extra
    pyproject.toml lacks, or (outside acb/'s own messages) a line that does not install from
    the checkout a reader stands in."""
    import re

    problems = []
    for spec in _acb_specs(words):
        m = re.fullmatch(r"([^\[]*)(?:\[(.*)\])?", spec)
        assert m
        name, wanted = m.group(1), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
        if name not in (".", "acb-batching"):
            problems.append(f"{where}: {spec!r}: the distribution is acb-batching (acb is another project)")
        if wanted - extras:
            problems.append(f"{where}: {spec!r}: no extra {sorted(wanted - extras)} in pyproject.toml")
        if name != ".":
            problems.append(f'{where}: {spec!r}: not published: install from the checkout, pip install -e ".[...]"')
    return problems


def test_every_install_line_installs_acb_batching_with_extras_that_exist():
    """A reader copies an install line and it works: ``acb[eval]`` (another project's name) or
    an extra pyproject.toml lacks would not; the pages and examples use the checkout's form.
    The sentences that say what ``pip install acb`` is and what the published name will be are
    the exception."""
    extras = _extras()
    lines = _install_lines()
    assert len(lines) >= 15
    problems = [p for where, words in lines for p in check_install_line(where, words, extras)]
    assert problems == []
    # the check bites on the lines issue 37 found
    assert check_install_line("docs/guides/evaluating.md:20", '"acb[eval]"', extras)
    assert check_install_line("examples/x.py:3", "'acb-batching[serve]' openai", extras)
    assert check_install_line("docs/x.md:1", '-e ".[nope]"', extras)
    assert not check_install_line("docs/x.md:1", '-e ".[serve,otel]" openai', extras)
    # acb's own messages and docstrings too, and a line broken after "pip install"
    assert check_install_line("acb/structured.py:99", "'acb-batching[structured]'", extras)
    assert _install_lines_of("x\nneeds ``pip install\n    'acb-batching[eval]'``", "acb/x.py") == [
        ("acb/x.py:2", "'acb-batching[eval]'")
    ]


def test_getting_started_lists_every_extra_and_the_model_size():
    """The extras table is pyproject.toml's, and the default model's size is the model's."""
    import re

    from acb.models import DEFAULT_MODEL_CONFIG, default_model

    page = (ROOT / "docs" / "getting-started.md").read_text()
    listed = set(re.findall(r"^\| `\[(\w+)\]` \|", page, flags=re.M))
    assert listed == _extras()
    size = sum(p.numel() for p in default_model().parameters())
    layers, hidden = DEFAULT_MODEL_CONFIG["num_hidden_layers"], DEFAULT_MODEL_CONFIG["hidden_size"]
    assert (
        f"({layers} layers, hidden {hidden}, {size / 1e6:.1f}M\nparameters)" in page
        or f"({layers} layers, hidden {hidden}, {size / 1e6:.1f}M parameters)" in page
    )


def suite_size_problem(page: str, collected: int) -> str | None:
    """What is wrong with the suite size docs/development.md states, given a whole run's count."""
    import re

    m = re.search(r"The suite is about ([\d,]+) tests", page)
    if not m:
        return "docs/development.md no longer states the suite's size"
    stated = int(m.group(1).replace(",", ""))
    if abs(stated - collected) > 0.1 * collected:
        return f"the suite has {collected} tests; docs/development.md says about {stated}"
    return None


def test_the_suite_size_on_the_development_page_is_current(request):
    """docs/development.md says how many tests the suite has; a whole-suite run (the README's
    ``python -m pytest -q``) checks it against what it collected, within 10%."""
    opt = request.config.option
    files = {Path(str(item.path)).resolve() for item in request.session.items}
    every = {f.resolve() for f in (ROOT / "tests").rglob("test_*.py")}
    assert suite_size_problem("The suite is about 469 tests", 950)  # the figure issue 37 found stale
    assert not suite_size_problem("The suite is about 1,000 tests", 950)
    if files != every or opt.keyword or opt.markexpr or opt.deselect or getattr(opt, "lf", False):
        pytest.skip("checked by a whole-suite run (python -m pytest), which collects every test")
    problem = suite_size_problem((ROOT / "docs" / "development.md").read_text(), len(request.session.items))
    assert problem is None, problem


def test_a_hub_id_without_the_hub_fails_at_once_saying_how_to_use_a_folder(tmp_path):
    """Getting started's promise: with ``HF_HUB_OFFLINE=1`` a hub id that is not in the cache
    fails at once (no retries: nothing is fetched) with a message that says how to use a local
    folder instead."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    code = "import acb\nacb.Engine.from_pretrained('acb-docs-test/no-such-model')"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Retrying" not in p.stderr
    assert "OSError: cannot load 'acb-docs-test/no-such-model': it is not a local folder" in p.stderr, p.stderr[-2000:]
    assert "hf download ORG/NAME --local-dir DIR" in p.stderr and "HF_HUB_OFFLINE=1" in p.stderr


def test_the_embedded_tokenizer_renders_chats_tools_and_calls():
    """Get a model's promise: the embedded tokenizer has a chat template with tools. A plain chat
    renders as ``role: content`` lines (what ``acb generate`` always gave it); tools are listed;
    an assistant's calls render as the Hermes tags that ``acb serve --tool-call-parser hermes``
    reads back, so a history round-trips."""
    import json

    from acb.models import build_tokenizer
    from acb.serve.tool_parsers import HermesToolParser

    tok = build_tokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris?"}]
    assert (
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        == "system: be brief\nuser: Weather in Paris?\nassistant: "
    )
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        *chat,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(history, tools=[weather], tokenize=False, add_generation_prompt=True)
    assert text.startswith('tools:\n{"name": "get_weather"') and text.endswith(
        "tool: sunny (result of call_1)\nassistant: "
    )
    said = text.split("assistant: ")[1].split("\n")[0]
    _, (parsed,) = HermesToolParser().extract(said)
    assert parsed.name == "get_weather" and json.loads(parsed.arguments) == {"city": "Paris"}


def test_the_readme_test_command_is_what_ci_runs():
    """The README says its test command is exactly what .ci/run does; ruff and mypy come first."""
    import re

    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme
    assert re.search(r"ruff format --check && ruff check && mypy && python -m pytest -q -n 2 --dist loadfile$", ci)
