"""Loading an experiment script from its file (experiments/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def load_script(name: str):
    """Import ``experiments/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"_experiment_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
