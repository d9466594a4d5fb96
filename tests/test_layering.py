"""The import graph of DESIGN.md section 1, checked by parsing every module with ast.

Allowed edges between our packages: experiments -> engine, models, scheduler, pallas_kernels;
engine -> models, scheduler, pallas_kernels; models -> pallas_kernels. scheduler imports nothing
of ours and neither jax nor numpy (stdlib only). Nothing imports experiments or tests.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"engine", "scheduler", "models", "pallas_kernels", "experiments", "tests"}
ALLOWED = {
    "experiments": {"engine", "models", "scheduler", "pallas_kernels"},
    "engine": {"models", "scheduler", "pallas_kernels"},
    "models": {"pallas_kernels"},
    "pallas_kernels": set(),
    "scheduler": set(),
}
SCHEDULER_FORBIDDEN = {"jax", "jaxlib", "numpy", "flax", "optax"}


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
                if package == "scheduler" and name in SCHEDULER_FORBIDDEN:
                    bad.append(f"{path.relative_to(ROOT)} imports {name} (scheduler is stdlib only)")
    assert not bad, "imports not allowed by DESIGN.md section 1:\n" + "\n".join(bad)


def test_layering_check_sees_every_package():
    for package in ALLOWED:
        assert (ROOT / package / "__init__.py").exists(), package
