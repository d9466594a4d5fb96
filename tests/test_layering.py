"""The import graph of DESIGN.md section 1, checked by parsing every module with ast.

Allowed edges between our packages: experiments -> entrypoints, engine, models, text, scheduler,
pallas_kernels; entrypoints -> engine; engine -> models, text, scheduler, pallas_kernels (it
detokenizes); models -> text, pallas_kernels. scheduler imports nothing of ours and neither jax nor
numpy (stdlib only); text imports nothing of ours and no jax; entrypoints imports no jax, and
neither does anything it loads at import time (engine is imported for its light modules; LLMEngine
lazily). Nothing imports experiments or tests.
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
