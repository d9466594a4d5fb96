"""The import graph of DESIGN.md section 1, checked by parsing every module with ast.

Allowed edges between our packages: experiments -> entrypoints, engine, models, text, scheduler,
pallas_kernels; entrypoints -> engine; engine -> models, text, scheduler, pallas_kernels (it
detokenizes); models -> text, pallas_kernels. scheduler imports nothing of ours and neither jax nor
numpy (stdlib only); text imports nothing of ours and no jax; entrypoints imports no jax, and
neither does anything it loads at import time (engine is imported for its light modules; LLMEngine
lazily). Nothing imports experiments or tests.

Inside a package, its wings (sub-packages) point one way too: WINGS lists, per wing, the wings
it may import (a wing may always import itself). And no module imports itself around a loop:
the graph of every import of ours (module level, inside functions, under TYPE_CHECKING, relative
ones; each resolved to the module it names) has no circle. The checkers take the root of a tree,
so the tests at the bottom show them failing on a planted circle and a planted upward import.
"""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"engine", "scheduler", "models", "text", "pallas_kernels", "entrypoints", "experiments", "tests"}
ALLOWED = {
    "experiments": {"entrypoints", "engine", "models", "text", "scheduler", "pallas_kernels"},
    "entrypoints": {"engine"},
    "engine": {"models", "text", "scheduler", "pallas_kernels"},
    "models": {"text", "pallas_kernels"},
    "text": set(),
    "pallas_kernels": set(),
    "scheduler": set(),
}
JAX = {"jax", "jaxlib", "flax", "optax"}
FORBIDDEN = {
    "scheduler": JAX | {"numpy"},
    "text": JAX,
    "entrypoints": JAX,
}
WHY = {"scheduler": "scheduler is stdlib only", "text": "text has no jax", "entrypoints": "entrypoints has no jax"}

# engine's wings, lowest first. "engine" is the shared vocabulary (the modules at engine/'s top:
# configs, SamplingParams, outputs, errors, RowParams, metrics); "engine.__init__" is the public
# API (`from engine import LLM, ...`), on top of everything it re-exports.
_VOCABULARY = {"engine"}
_FEATURES = _VOCABULARY | {"engine.spec_decode", "engine.structured_output", "engine.lora"}
_STEP = _FEATURES | {"engine.step"}
_CORE = _STEP | {"engine.core"}
_DISAGGREGATION = _CORE | {"engine.disaggregation"}
_SCALEOUT = _DISAGGREGATION | {"engine.scaleout"}
WINGS = {
    "engine": set(),
    "engine.spec_decode": _VOCABULARY,
    "engine.structured_output": _VOCABULARY,
    "engine.lora": _VOCABULARY,
    "engine.step": _FEATURES,
    "engine.core": _STEP,
    "engine.disaggregation": _CORE,
    "engine.scaleout": _DISAGGREGATION,
    "engine.frontends": _SCALEOUT,
    "engine.__init__": _SCALEOUT | {"engine.frontends"},
    # experiments: the shared parts (lab) below the idea experiments, the benchmarks and the
    # tools at experiments/'s top ("experiments": capacity, generate, train_draft); nothing in
    # experiments imports the tools, and ideas and bench do not import each other.
    "experiments.lab": set(),
    "experiments.ideas": {"experiments.lab"},
    "experiments.bench": {"experiments.lab"},
    "experiments": {"experiments.lab"},
}
MAX_VOCABULARY_MODULES = 12  # engine/*.py, __init__ included


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def modules(root: pathlib.Path, packages) -> dict[str, pathlib.Path]:
    """Every module of these top-level packages under root, by dotted name."""
    return {module_name(root, path): path for package in sorted(packages)
            for path in sorted((root / package).rglob("*.py"))}


def imported_modules(name: str, path: pathlib.Path, known) -> set[str]:
    """The modules of `known` that the module imports anywhere in its body: `import a.b` names
    a.b, `from a import b` names a.b when that is a module and else a; relative imports resolve
    against the module's package."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()

    def add(dotted: str) -> None:
        while dotted and dotted not in known:  # `import a.b.c` with c a name: its module
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    found.discard(name)
    return found


def import_graph(root: pathlib.Path, packages=OURS) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, over every module of `packages` under root."""
    found = modules(root, packages)
    return {name: imported_modules(name, path, found) for name, path in found.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative: no recursion limit
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def wing_of(name: str, wings) -> str | None:
    """The wing a module belongs to: a package's __init__ when the table names it, else the
    longest wing its name starts with."""
    if f"{name}.__init__" in wings:
        return f"{name}.__init__"
    matches = [wing for wing in wings if name == wing or name.startswith(wing + ".")]
    return max(matches, key=len) if matches else None


def wing_violations(graph: dict[str, set[str]], wings: dict[str, set[str]]) -> list[str]:
    """Every edge from one wing of the table to another of the same package that the table does
    not allow (edges between packages are ALLOWED's)."""
    bad = []
    for name in sorted(graph):
        source = wing_of(name, wings)
        for target in sorted(graph[name]):
            dest = wing_of(target, wings)
            if (source and dest and dest != source and dest not in wings[source]
                    and source.partition(".")[0] == dest.partition(".")[0]):
                bad.append(f"{name} imports {target} ({source} may not import {dest})")
    return bad


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_import_edges_follow_design():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path):
                if name in OURS and name != package and name not in allowed:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
                if name in FORBIDDEN.get(package, ()):
                    bad.append(f"{path.relative_to(ROOT)} imports {name} ({WHY[package]})")
    assert not bad, "imports not allowed by DESIGN.md section 1:\n" + "\n".join(bad)


def test_layering_check_sees_every_package():
    for package in ALLOWED:
        assert (ROOT / package / "__init__.py").exists(), package


def test_wings_point_one_way():
    bad = wing_violations(import_graph(ROOT), WINGS)
    assert not bad, "imports between wings that WINGS does not allow:\n" + "\n".join(bad)


def test_wing_table_sees_every_wing():
    for package in {wing.partition(".")[0] for wing in WINGS}:
        found = {module_name(ROOT, init.parent) for init in (ROOT / package).glob("*/__init__.py")}
        named = {wing for wing in WINGS if wing.count(".") == 1 and not wing.endswith(".__init__")}
        assert found == {w for w in named if w.startswith(package + ".")}, package
    assert len(list((ROOT / "engine").glob("*.py"))) <= MAX_VOCABULARY_MODULES


def test_no_import_circles():
    graph = import_graph(ROOT)
    # The graph counts imports inside functions: the public API's lazy ones are edges.
    assert {"engine.frontends.llm", "engine.core.llm_engine"} <= graph["engine"]
    found = circles(graph)
    assert not found, "modules that import each other, directly or around a loop:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_text_and_entrypoints_load_without_jax():
    # The ast check sees each file's own imports; this one follows what they load at import time
    # (entrypoints -> engine's light modules), in a fresh interpreter.
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in ("text", "entrypoints")
        for path in sorted((ROOT / package).rglob("*.py"))
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(n for n in {sorted(JAX)!r} if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {modules} loaded {out.stdout.strip()}"


def _plant(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_circle_checker_finds_planted_circles(tmp_path):
    root = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",  # a -> b, b -> a inside a function
        "pkg/b.py": "def f():\n    from pkg.a import thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from . import d\n",  # c -> d -> e -> c, relative and TYPE_CHECKING
        "pkg/sub/d.py": "from .. import sub\nfrom pkg.sub.e import E\n",
        "pkg/sub/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub.c import C\n",
        "pkg/clean.py": "import pkg.a\nimport os\n",
    })
    graph = import_graph(root, {"pkg"})
    assert graph["pkg.sub.d"] == {"pkg.sub", "pkg.sub.e"} and graph["pkg.clean"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d", "pkg.sub.e"]]
    (root / "pkg/b.py").write_text("")
    (root / "pkg/sub/e.py").write_text("")
    assert circles(import_graph(root, {"pkg"})) == []


def test_wing_checker_finds_a_planted_upward_import(tmp_path):
    # engine's own table on a small tree: the step importing the engine loop goes up.
    root = _plant(tmp_path, {
        "engine/__init__.py": "def __getattr__(name):\n    from engine.frontends.llm import LLM\n",
        "engine/config.py": "",
        "engine/step/__init__.py": "",
        "engine/step/model_runner.py": "from engine.config import EngineConfig\n",
        "engine/core/__init__.py": "",
        "engine/core/llm_engine.py": "from engine.step.model_runner import ModelRunner\n",
        "engine/frontends/__init__.py": "",
        "engine/frontends/llm.py": "from engine.core.llm_engine import LLMEngine\n",
    })
    assert wing_violations(import_graph(root, {"engine"}), WINGS) == []
    (root / "engine/step/model_runner.py").write_text(
        "from engine.config import EngineConfig\n\n\ndef f():\n    from engine.core import llm_engine\n")
    (root / "engine/config.py").write_text("import engine\n")  # the vocabulary reaching the API
    assert wing_violations(import_graph(root, {"engine"}), WINGS) == [
        "engine.config imports engine (engine may not import engine.__init__)",
        "engine.step.model_runner imports engine.core.llm_engine (engine.step may not import engine.core)",
    ]
