"""zarr-python data types for ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``.

They live in :mod:`zarrckpt_dtypes.zarr_types` (no torch), which zarr-python loads
through its entry points without ``import zarrckpt``; this module re-exports them.
"""

from __future__ import annotations

from zarrckpt_dtypes.zarr_types import BFloat16, Float8E4M3FN, Float8E5M2, register_zarr_dtypes

__all__ = ["BFloat16", "Float8E4M3FN", "Float8E5M2", "register_zarr_dtypes"]
