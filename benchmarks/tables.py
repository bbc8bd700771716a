"""What the report modules share: the Target type, medians and ratios, markdown tables, library rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    threshold: float
    higher_is_better: bool
    unit: str  # "x" (a ratio), "%", "n" (a count, or tenths of one) or "s" (seconds)
    profile: str | None = None  # the profiled operation to show when missed

    @property
    def ok(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.threshold if self.higher_is_better else self.measured <= self.threshold

    @property
    def margin(self) -> float | None:
        """> 1 when met: measured / threshold, or threshold / measured for upper bounds."""
        if self.measured is None or self.measured <= 0:
            return None
        return self.measured / self.threshold if self.higher_is_better else self.threshold / self.measured

    def fmt(self, value: float) -> str:
        if self.unit == "n":  # a count (round trips come in tenths: a read's time over a latency)
            return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
        if self.unit == "s":  # seconds
            return f"{value:.2f} s"
        return f"{value:.0%}" if self.unit == "%" else f"{value:.2f}x"


def median(runs: list[dict[str, Any]], name: str, field: str = "s") -> float | None:
    values = [r[name][field] for r in runs if name in r and field in r[name]]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table; the first ``left`` columns align left, the others right."""
    align = "|" + "---|" * left + "---:|" * (len(header) - left)
    return ["| " + " | ".join(header) + " |", align] + ["| " + " | ".join(r) + " |" for r in rows]


def fmt(v: float | None, pattern: str = "{:.2f}") -> str:
    """``v`` formatted, or "n/a"."""
    return "n/a" if v is None else pattern.format(v)


LIB_NAMES = {
    "zarrckpt": "zarrckpt",
    "dcp": "DCP",
    "tensorstore": "TensorStore zarr3",
    "raw": "raw: 1 file per rank, sequential",
    "raw8": "raw: 1 file per shard, 8 threads",
    "raw-files": "raw: 2 files per tensor (data + 700 B), 8 threads",
    "s3tc": "s3torchconnector (DCP + S3StorageWriter / Reader)",
}
LIB_HEADER = ["library", "median s", "GB/s", "time / zarrckpt's", "machine CPU busy", "every repetition (s)"]
RAW_SHARE = "share of the raw limit"  # the raw write's median time / this library's (1 = as fast as raw)


def raw_limit(runs: list[dict[str, Any]], op: str) -> float | None:
    """The faster raw write's median time for ``op`` (None where no raw baseline ran)."""
    times = [t for t in (median(runs, f"{op}/raw"), median(runs, f"{op}/raw8")) if t is not None]
    return min(times) if times else None


def lib_rows(
    runs: list[dict[str, Any]], op: str, libs: list[str], nbytes: int, raw_s: float | None = None
) -> list[list[str]]:
    """One row per library that ran ``op``; with ``raw_s`` (the raw limit), a last column: its share."""
    rows = []
    ref_s = median(runs, f"{op}/zarrckpt")
    for lib in libs:
        s = median(runs, f"{op}/{lib}")
        if s is None:
            continue
        per = [r[f"{op}/{lib}"]["s"] for r in runs if f"{op}/{lib}" in r]
        busy = median(runs, f"{op}/{lib}", "machine_busy")
        rows.append(
            [
                LIB_NAMES.get(lib, lib),
                f"{s:.2f}",
                f"{nbytes / s / GB:.2f}",
                fmt(ratio(s, ref_s)),
                fmt(busy, "{:.0%}"),
                ", ".join(f"{x:.2f}" for x in per),
                *([fmt(ratio(raw_s, s), "{:.0%}")] if raw_s is not None else []),
            ]
        )
    return rows
