"""A package's public names, imported on first use (floor 0).

The packages whose modules import torch, transformers or pandas (``otbrl.algos``, ``data``,
``models``, ``rollout``) re-export their names lazily, so that importing one light module of
theirs — a component's settings, read by the CLI's schema — does not import the rest: the CLI
answers ``--help`` without loading torch (``tests/test_config.py`` checks it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(
    package: str, table: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``: ``table`` maps each submodule
    (relative to the package) to the names it exports."""
    where = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
