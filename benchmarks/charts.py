"""PNG charts of a ``run.py`` report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
from tables import GB, LIB_NAMES, MIB, Target, median

COLORS = {
    "zarrckpt": "#1f77b4",
    "dcp": "#ff7f0e",
    "s3tc": "#9467bd",
    "tensorstore": "#2ca02c",
    "raw": "#7f7f7f",
    "raw8": "#bcbd22",
}
WIDTH = 0.13  # one bar per library in COLORS, centred on its group


def throughput(runs: list[dict[str, Any]], info: dict[str, Any], path: Path) -> bool:
    groups = [
        ("save\nlocal", "save", info["state_bytes"]),
        ("reshard load\nlocal", "reshard", info["state_bytes"]),
        ("save\nS3 (moto)", "s3_save", info["s3_state_bytes"]),
        ("reshard load\nS3 (moto)", "s3_reshard", info["s3_state_bytes"]),
        ("save\nS3 (RGW)", "rgw_save", info["s3_state_bytes"]),
        ("reshard load\nS3 (RGW)", "rgw_reshard", info["s3_state_bytes"]),
    ]
    libs = list(COLORS)
    data = {(op, lib): median(runs, f"{op}/{lib}") for _, op, _ in groups for lib in libs}
    groups = [g for g in groups if any(data[(g[1], lib)] for lib in libs)]
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = WIDTH
    for i, lib in enumerate(libs):
        xs, ys = [], []
        for j, (_, op, nbytes) in enumerate(groups):
            s = data[(op, lib)]
            if s:
                xs.append(j + (i - (len(libs) - 1) / 2) * width)
                ys.append(nbytes / s / GB)
        if xs:
            bars = ax.bar(xs, ys, width, label=LIB_NAMES[lib], color=COLORS[lib])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("GB/s (state bytes / median time)")
    ax.set_title("Throughput, medians (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def targets(goals: list[Target], path: Path) -> bool:
    rows = [t for t in goals if t.margin is not None]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ys = range(len(rows))
    margins = [t.margin or 0 for t in rows]
    ax.barh(ys, margins, color=["#2ca02c" if t.ok else "#d62728" for t in rows])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(ys, [f"{t.name} ({t.fmt(t.measured or 0)})" for t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # (minor labels overlapped the major ones)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("measured vs goal (> 1: met; log scale)")
    ax.set_title("Targets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def memory(runs: list[dict[str, Any]], path: Path) -> bool:
    ops = ["save", "reshard", "s3_save", "s3_reshard", "rgw_save", "rgw_reshard"]
    libs = list(COLORS)
    data = {(op, lib): median(runs, f"{op}/{lib}", "rss_extra") for op in ops for lib in libs}
    ops = [op for op in ops if any(data[(op, lib)] is not None for lib in libs)]
    if not ops:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    width = WIDTH
    for i, lib in enumerate(libs):
        pts = [
            (j + (i - (len(libs) - 1) / 2) * width, data[(op, lib)] / MIB)
            for j, op in enumerate(ops)
            if data[(op, lib)] is not None
        ]
        if pts:
            bars = ax.bar([p[0] for p in pts], [p[1] for p in pts], width, label=LIB_NAMES[lib], color=COLORS[lib])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(ops)), ops)
    ax.set_ylabel("MiB above the RSS before the call (max rank)")
    ax.set_title("Peak RSS added by each operation (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw_all(runs: list[dict[str, Any]], goals: list[Target], info: dict[str, Any], out_dir: Path) -> list[str]:
    """Draw every chart that has data; returns the file names written under ``out_dir``."""
    written = []
    for name, draw in (
        ("throughput.png", lambda p: throughput(runs, info, p)),
        ("targets.png", lambda p: targets(goals, p)),
        ("memory.png", lambda p: memory(runs, p)),
    ):
        if draw(out_dir / name):
            written.append(name)
    return written
