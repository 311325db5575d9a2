"""A module proxy that imports on first attribute access.

A model family is one file holding its tensor table (read by the compiler, which must not
import torch) and its forward (torch). The forward reaches torch through these proxies, so
importing a family for its table costs nothing and works without torch installed."""

from __future__ import annotations

import importlib


class LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def __getattr__(self, attr: str):
        module = object.__getattribute__(self, "_module")
        if module is None:
            module = importlib.import_module(object.__getattribute__(self, "_name"))
            object.__setattr__(self, "_module", module)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {object.__getattribute__(self, '_name')!r}>"
