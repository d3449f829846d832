"""The library logs through per-module loggers under ``acb``, installs no handlers, and does
not prefix its messages with "acb:" (the logger name already says where they come from)."""

from __future__ import annotations

import importlib
import logging
import pkgutil
import re
from pathlib import Path

import acb
from tests.conftest import get_model

OPTIONAL = ("acb.runner.attention.flash_attn_backend",)  # needs flash-attn to import


def _import_all() -> list[str]:
    names = []
    for mod in pkgutil.walk_packages(acb.__path__, "acb."):
        if mod.name in OPTIONAL:
            continue
        importlib.import_module(mod.name)
        names.append(mod.name)
    return names


def test_loggers_are_named_by_module_and_have_no_handlers():
    modules = set(_import_all()) | {"acb"}
    loggers = {name for name in logging.root.manager.loggerDict if name == "acb" or name.startswith("acb.")}
    # every acb logger is a module's (or a package on the way to one), none invented
    packages = {m.rsplit(".", k)[0] for m in modules for k in range(m.count(".") + 1)}
    assert loggers <= modules | packages, loggers - modules - packages
    assert any(name.count(".") >= 2 for name in loggers)  # e.g. acb.core.engine_core
    for name in loggers:
        logger = logging.getLogger(name)
        assert not logger.handlers, f"{name} has handlers {logger.handlers}"
        assert logger.propagate


def test_sources_use_module_loggers_without_a_prefix():
    root = Path(acb.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"getLogger\(([^)]*)\)", text):
            # the processes acb starts configure the tree they own (acb, transformers): the CLI, and
            # the server's launch path (a Ray Serve replica runs it without the CLI, for --verbose);
            # the library only names its own
            owner = path.parent.name == "cli" or path.relative_to(root).as_posix() == "serve/launch.py"
            assert m.group(1) == "__name__" or owner, f"{path}: getLogger({m.group(1)})"
        assert not re.search(r"logger\.\w+\(\s*f?\"acb: ", text), f"{path}: a log message starts with 'acb: '"


def test_a_library_message_comes_from_its_module(caplog):
    model = get_model("llama")
    with (
        caplog.at_level(logging.INFO, logger="acb"),
        acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32)) as eng,
    ):
        assert eng.cancel("no-such-request") is False
    records = [r for r in caplog.records if "no-such-request" in r.getMessage()]
    assert records and records[0].name == "acb.api.base"
    assert not records[0].getMessage().startswith("acb")
