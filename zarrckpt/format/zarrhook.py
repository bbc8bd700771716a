"""Teach zarr-python zarrckpt's ``bfloat16`` / ``float8`` data types without importing zarr first.

``import zarrckpt`` promises that plain zarr-python reads our arrays afterwards, but importing
zarr (0.2 s) and ml_dtypes (0.5 s) up front would slow down every ``zarrckpt`` command. So: when
zarr is already imported, register now; otherwise a one-shot finder on ``sys.meta_path``
registers right after ``import zarr`` has finished, whenever that happens.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("zarrckpt")


def _register() -> None:
    try:
        from zarrckpt_dtypes.zarr_types import register_zarr_dtypes

        register_zarr_dtypes()
    except Exception as exc:  # never break the user's `import zarr`
        log.debug("zarr custom dtypes not registered: %r", exc)


class _AfterZarrImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of ``zarr`` so that registration follows it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "zarr":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            del loader.exec_module  # this loader instance serves zarr alone; undo the wrap
            _register()

        loader.exec_module = exec_module
        return spec


def register_with_zarr() -> None:
    """Register now if zarr is imported, else as soon as it is."""
    if "zarr" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterZarrImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterZarrImport())
