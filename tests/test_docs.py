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
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_configuration_page_is_current():
    p = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_config.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
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
    p = subprocess.run([sys.executable, "-m", "acb", "bench", "report", "--update-readme", str(copy), "--no-plot"],
                       cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert copy.read_text() == (ROOT / "benchmarks" / "RESULTS.md").read_text(), \
        "benchmarks/RESULTS.md is stale: run acb bench report --update-readme benchmarks/RESULTS.md"


def test_every_public_method_documents_its_arguments():
    """One docstring style (Google's): every public function and method of ``acb.__all__`` that
    takes arguments has an ``Args:`` section (the API reference renders it as a table)."""
    import inspect

    import acb

    missing = []
    for name in acb.__all__:
        obj = getattr(acb, name)
        members = [(name, obj)] if inspect.isfunction(obj) else [
            (f"{name}.{m}", f) for m, f in inspect.getmembers(obj)
            if inspect.isclass(obj) and not m.startswith("_") and inspect.isfunction(f)
            and f.__module__.startswith("acb.")]
        for qual, f in members:
            params = [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]
            if params and "Args:" not in (inspect.getdoc(f) or ""):
                missing.append(qual)
    assert not missing, f"no Args: section: {missing}"
