"""The layering rules (docs/ARCHITECTURE.md, "The layering rules"), checked on the source (static:
every ``import`` that runs, i.e. outside ``if TYPE_CHECKING:`` blocks, at module level or inside
functions; the cycle and root checks also count the ``TYPE_CHECKING`` ones).

- ``acb.core`` is plain Python: no torch, no asyncio/anyio, and nothing from the layers above it.
- ``acb.runner`` never imports asyncio and nothing above it (api, serve, distributed, ...).
- ``acb.api`` does not import the server, the integrations, scale-out, the CLI or the benchmarks.
- Nothing the CLI builds on (the server, scale-out, the model loader) imports the CLI.
- No import cycle among acb's modules, counting the imports inside functions (a circle hidden in a
  function is still a circle) and the type-only ones (a ``Protocol`` or a shared types module
  breaks those).
- No module inside acb imports the root package (``import acb``, ``from acb import Engine``): each
  imports a name from the module that defines it (the root's ``__init__`` imports them all, so a
  module it reaches that reaches back is a circle).
- No private name (``_name``) imported from one of acb's modules into another.
- Each optional dependency is imported in its one home module.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "acb"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, *, module_level_only: bool = False, type_only: bool = False) -> list[str]:
    """The modules ``path`` imports at run time (``from a import b`` gives ``a`` and ``a.b``);
    with ``type_only``, the ``TYPE_CHECKING`` ones too."""
    found: list[str] = []
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if type_only:
                self.generic_visit(node)
                return
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if not module_level_only:
                self.generic_visit(node)

        visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

        def visit_Import(self, node: ast.Import) -> None:
            found.extend(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.append(mod)
            found.extend(f"{mod}.{a.name}" for a in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return found


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


ABOVE_CORE = (
    "acb.api",
    "acb.runner",
    "acb.serve",
    "acb.distributed",
    "acb.integrations",
    "acb.cli",
    "acb.bench",
    "acb.telemetry",
    "acb.structured",
)
ABOVE_RUNNER = ("acb.api", "acb.serve", "acb.distributed", "acb.integrations", "acb.cli", "acb.bench")
ABOVE_API = ("acb.serve", "acb.distributed", "acb.integrations", "acb.cli", "acb.bench")


@pytest.mark.parametrize(
    "layer,banned",
    [
        ("acb.core", ("torch", "asyncio", "anyio", "numpy", *ABOVE_CORE)),
        ("acb.runner", ("asyncio", "anyio", *ABOVE_RUNNER)),
        ("acb.api", ABOVE_API),
        # the CLI is the top: the server, scale-out and the loaders below it never reach back into
        # it, not even inside a function (a Ray Serve replica once parsed argv with the CLI's parser)
        ("acb.serve", ("acb.cli",)),
        ("acb.distributed", ("acb.cli",)),
        ("acb.model_source", ("acb.cli", "acb.serve", "acb.distributed")),
    ],
)
def test_no_upward_imports(layer, banned):
    bad = [
        (name, imp)
        for name, path in MODULES.items()
        if _under(name, layer)
        for imp in _imports(path)
        if _under(imp, *banned)
    ]
    assert not bad, f"{layer} imports what it must not: {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def _real_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` that pass through no package: a package's ``__init__`` runs before
    its submodules, so an edge into a package (``from acb import telemetry``) is not a dependency
    on what the package re-exports."""
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    return [c for c in _cycles(graph) if not set(c) & packages]


def _graph(*, type_only: bool = False) -> dict[str, set[str]]:
    return {
        name: {imp for imp in _imports(path, type_only=type_only) if imp in MODULES and imp != name}
        for name, path in MODULES.items()
    }


def test_no_import_cycles_even_inside_functions():
    """acb's modules import each other one way only, counting the imports inside functions (app
    once imported responses in build_app, and responses imported app's helpers; the CLI, the
    server and the Ray Serve replica once went round through functions)."""
    graph = _graph()
    assert not _real_cycles(graph), f"import cycles: {_real_cycles(graph)}"


def test_no_import_cycles_even_type_only():
    """...nor through ``if TYPE_CHECKING:`` imports (config and grammar_budget once named each
    other's types: a ``Protocol`` in the lower module broke it; kinds reads the runner through one)."""
    graph = _graph(type_only=True)
    assert not _real_cycles(graph), f"import cycles (type-only imports counted): {_real_cycles(graph)}"


def _root_imports(path: pathlib.Path, text: str | None = None) -> list[str]:
    """What ``path`` (or ``text``, as if it were ``path``'s) imports of the root package itself
    (``import acb``; ``from acb import X`` where ``acb.X`` is no module), anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            found.extend("acb" for a in node.names if a.name == "acb")
        elif isinstance(node, ast.ImportFrom) and node.module == "acb" and not node.level:
            found.extend(f"acb.{a.name}" for a in node.names if f"acb.{a.name}" not in MODULES)
    return found


def test_no_module_imports_the_root_package():
    """Inside acb, a name is imported from the module that defines it, never through the root
    package (telemetry once read ``acb.__version__`` and model_source ``acb.Engine``, inside
    functions: a circle through ``acb/__init__.py``); ``from acb import telemetry`` (a
    submodule) is fine."""
    bad = [(name, imp) for name, path in MODULES.items() if name != "acb" for imp in _root_imports(path)]
    assert not bad, f"imports of the root package inside it: {bad}"


def test_the_root_import_check_sees_them():
    src = ROOT / "serve" / "_probe_root_imports.py"  # (read, never imported)
    text = "import acb\nfrom acb import telemetry\ndef f():\n    from acb import Engine, errors\n"
    assert _root_imports(src, text) == ["acb", "acb.Engine"]


def test_the_cycle_check_sees_a_circle_hidden_in_a_function():
    """The check above finds a circle whose one edge is an import inside a function: a module
    that imports another only in a function, given a module-level import back."""
    name, inner = next(
        (name, imp)
        for name, path in MODULES.items()
        for imp in sorted(set(_imports(path)) - set(_imports(path, module_level_only=True)))
        if imp in MODULES and not imp.endswith("__init__") and MODULES[imp].name != "__init__.py" and imp != name
    )
    graph = {n: set() for n in MODULES}
    graph[name].add(inner)  # the import inside a function
    graph[inner].add(name)  # and one back
    assert _real_cycles(graph) == [sorted([name, inner]) + [min(name, inner)]]


def _private_imports(path: pathlib.Path, text: str | None = None) -> list[tuple[str, str]]:
    """``(module, name)`` for each ``from acb.x import _name`` in ``path`` (or in ``text``, as if it
    were ``path``'s), relative imports resolved, inside functions too."""
    found = []
    package = _module_name(path).rpartition(".")[0] if path.name != "__init__.py" else _module_name(path)
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:  # from .app import _x
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{module}" if module else base
        found.extend((module, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
    return found


def test_no_private_names_across_modules():
    """No module of acb imports another's private names (``from acb.serve.app import _parse``,
    ``from acb.cli.serve import _add_serve``): what modules share is public, in the module that
    owns it."""
    found = {
        (name, mod, imp)
        for name, path in MODULES.items()
        for mod, imp in _private_imports(path)
        if _under(mod, "acb") and mod != name
    }
    bad = sorted(found)
    assert not bad, f"private names imported across acb's modules: {bad}"


def test_the_private_import_check_sees_them():
    """The check above finds a private import, at module level or in a function."""
    src = ROOT / "serve" / "_probe_private_imports.py"  # (read, never imported)
    text = (
        "from acb.serve.app import _parse, build_app\n"
        "def f():\n    from acb.serve.pipeline import _span_failed\n    from .responses import _Events\n"
    )
    assert sorted(_private_imports(src, text)) == [
        ("acb.serve.app", "_parse"),
        ("acb.serve.pipeline", "_span_failed"),
        ("acb.serve.responses", "_Events"),
    ]


# optional dependency -> the modules allowed to import it (the extra's home), and why more than one
OPTIONAL = {
    "xgrammar": {"acb.structured"},
    "flash_attn": {"acb.runner.attention.flash_attn_backend"},
    "triton": {
        "acb.runner.attention.triton_kernels",
        "acb.runner.lora_kernels",  # LoRA's shrink/expand kernels (acb.runner.lora's kernel form)
        "acb.runner.batch_invariant_kernels",  # the batch-invariant mode's fixed-order matmul and row mean (CUDA)
        "acb.structured",
    },  # acb.structured: only to ask whether xgrammar's GPU bitmask kernel can run
    "matplotlib": {"acb.bench.report"},
    "ray": {"acb.distributed.ray", "acb.distributed.ray_serve"},  # Ray Data offline, Ray Serve online
    "trl": {"acb.integrations.trl"},
    # the benchmark runs lm-eval itself, as a user does, to time it against its own hf backend
    "lm_eval": {"acb.integrations.lm_eval", "acb.bench.eval"},
    "opentelemetry.sdk": {"acb.telemetry"},
    "opentelemetry.exporter": {"acb.telemetry"},
    "prometheus_client": {"acb.telemetry"},
    # the server stack (extra "serve") lives in the acb.serve package alone
    "fastapi": {
        "acb.serve",
        "acb.serve.app",
        "acb.serve.loras",
        "acb.serve.pipeline",
        "acb.serve.protocol",
        "acb.serve.responses",
        "acb.serve.weights",
    },
    "uvicorn": {"acb.serve.launch"},
    "starlette": {"acb.serve.protocol", "acb.serve.ingress"},
}


@pytest.mark.parametrize("dep", sorted(OPTIONAL))
def test_optional_dependency_has_one_home(dep):
    users = {name for name, path in MODULES.items() if any(_under(imp, dep) for imp in _imports(path))}
    assert users <= OPTIONAL[dep], f"{dep} is imported outside its home: {sorted(users - OPTIONAL[dep])}"
