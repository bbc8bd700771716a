"""The report of ``run.py``: targets (PASS / MISS), one section per scenario, and PNG charts.

Input: ``runs`` (one dict per timed repetition: ``"<op>/<library>"`` -> measurement, see
``common.measure``; plus S3 request counts under ``"<op>/<library>/s3"``), ``lazy`` (the
driver-side lazy-read measurements) and ``info`` (run parameters and environment).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report_peers import MANY_TITLE, peer_lines, peer_miss_notes, peer_targets, section_many
from report_s3 import LAZY_TITLE, S3_TITLE, s3_targets, section_lazy, section_s3
from report_s3 import MISS_NOTES as S3_NOTES
from tables import LIB_HEADER, LIB_NAMES, MIB, RAW_SHARE, Target, median, ratio, raw_limit
from tables import fmt as _s
from tables import lib_rows as _lib_rows
from tables import table as _table

SECTIONS = {
    "local": ("## 1. Save, 4 ranks, local disk", "## 2. Resharding load 4 -> 3 ranks, local disk"),
    "s3": (S3_TITLE,),
    "lazy": (LAZY_TITLE,),
    "async": ("## 5. Async save: time training is blocked",),
    "rss": ("## 6. Peak RSS during save and load",),
    "many": (MANY_TITLE,),
}

# Causes of misses found by profiling (cProfile of rank 0, all threads) when the suite was written;
# printed under the targets table for each target that is missed. See benchmarks/README.md.
_ASYNC = (
    "the blocked time is the staging copy: each rank copies its 512 MiB into host buffers (rank 0's "
    "profile: `copy_` 0.07-0.12 s CPU on a later call, 0.19-0.22 s on the first, which also page-faults its fresh "
    "buffers) plus planning (~0.03 s, mostly DTensor offsets). Four ranks copying 2 GiB on 2 cores take "
    "0.2-0.3 s of wall time (0.6-0.9 s on a first call) against an fsync'd save of ~1.3-1.5 s: a CPU-only "
    "2-core box where memory copies are only ~5x faster than the disk. On a GPU node staging is a pinned "
    "device-to-host copy (~20+ GB/s per GPU) against a few GB/s of storage, where 10% is within reach "
    "(`benchmarks/gpu_save.py` measures it). DCP's `async_save` blocks 3-6x longer (fresh copy plus "
    "planning in the caller). Done: without a budget the background writes now start only once staging is "
    "done (1 GiB, quiet machine: blocked 0.348 -> 0.283 s first call, 0.149 -> 0.124 s repeat). Done since: "
    "`staging='background'` returns after planning and copies on a staging thread (its own rows below)."
)
_BACKGROUND = (
    "what is left on the caller's thread is planning. Rank 0's profile of a later call (2026-12-03): "
    "`async_save` 0.051 s, of which `plan_save` 0.037 s (waiting in the plan's scatter while the other ranks "
    "arrive and the coordinator plans: 0.018 s; collecting the state, DTensor offsets: 0.011 s). It does not "
    "grow with the bytes saved (0.004 s for a 0.25 GiB state on 2 ranks in `gpu_save.py --cpu-dry-run`). "
    "Not built: the plan cache issue 27 asks for. A plan holds the saved values (a step counter changes at "
    "every save) and which arrays are constant (a property of the data), so reusing one needs those parts "
    "split from the layout, and the ranks would still agree in one collective that no layout changed."
)
MISS_NOTES: dict[str, str] = {
    "resharding load 4->3: zarrckpt speed / DCP": (
        "both loads read the just-written files from the page cache, so they are bound by memory copies and "
        "checksums on 2 cores shared by 3 ranks (machine 92-95% busy). zarrckpt reads 1.06x the needed bytes "
        "once, straight into the targets (one `preadv` per run of whole chunks), and checks every byte's "
        "crc32c: rank 0's profile (2026-12-03) is 0.34 s of CPU, half of it `preadv` (the copy out of the page "
        "cache, 0.11 s) and crc32c (0.06 s), a quarter the calling thread's planning and manifest (0.085 s, "
        "waits included). DCP's is 0.45 s: it reads 1.5x the bytes and copies them twice (`readinto` 0.22 s, "
        "then `copy_` 0.11 s). A 2x lead would need zarrckpt to skip the check or "
        "the copy; it does neither. Earlier runs measured 1.39x-2.6x on the same code path, with the "
        "machine's load."
    ),
    **S3_NOTES,
    "async save, first call: blocked / sync save": _ASYNC,
    "async save, later calls: blocked / sync save": "same cause as the first call above.",
    "async save, staging='background', first call: blocked / sync save": _BACKGROUND,
    "async save, staging='background', later calls: blocked / sync save": _BACKGROUND,
    "save, local: zarrckpt speed / DCP": (
        "the goal is 1.5x since issue 27 (>= 1.5x DCP on every save; it was 1.2x). At small sizes (`--quick`) "
        "the save is bound by file creation and collectives (zarrckpt writes 334 files, DCP 5). At 2 GiB "
        "the ratio follows the page-cache pages each first save writes into: on this VM a page free for "
        "a while is handed back to the host and faults when written again. `benchmarks/fresh_pages.py` "
        "(2026-12-06): DCP / zarrckpt 1.97x on a process's first save, 2.85x after 40 s idle, 1.12-1.17x "
        "on pages just freed, where both write 2 GiB in 1.2-1.5 s (the machine's floor). Compare the "
        "share of the raw limit in section 1."
    ),
    "save, local: zarrckpt speed / raw write (faster variant)": (
        "not seen at 2 GiB; at small sizes (`--quick`) zarrckpt's 334 file creations dominate."
    ),
    "resharding load: zarrckpt read amplification": (
        "whole inner chunks are read where a target shard starts or ends inside one: about one chunk per "
        "boundary per tensor, small against a 2 GiB state (1.06x) but not at `--quick` sizes."
    ),
}
NO_NOTE = "no analysis recorded; `--profile DIR` adds a cProfile of rank 0."


def targets(runs: list[dict[str, Any]], lazy: dict[str, Any] | None, info: dict[str, Any]) -> list[Target]:
    def m(name: str, field: str = "s") -> float | None:
        return median(runs, name, field)

    def speedup(op: str) -> float | None:
        return ratio(m(f"{op}/dcp"), m(f"{op}/zarrckpt"))

    sync = m("save/zarrckpt")
    raw = raw_limit(runs, "save")
    amp = ratio(m("reshard/zarrckpt", "rchar"), info["state_bytes"]) if m("reshard/zarrckpt") else None
    return [
        Target("save, local: zarrckpt speed / DCP", speedup("save"), 1.5, True, "x", "save/zarrckpt"),
        Target(
            "save, local: zarrckpt speed / raw write (faster variant)",
            ratio(raw, sync),
            0.70,
            True,
            "%",
            "save/zarrckpt",
        ),
        Target("resharding load 4->3: zarrckpt speed / DCP", speedup("reshard"), 2.0, True, "x", "reshard/zarrckpt"),
        Target("resharding load: zarrckpt read amplification", amp, 1.1, False, "x", "reshard/zarrckpt"),
        Target(
            "async save, first call: blocked / sync save",
            ratio(m("async_first/zarrckpt", "blocked"), sync),
            0.10,
            False,
            "%",
            "async_first_call/zarrckpt",
        ),
        Target(
            "async save, later calls: blocked / sync save",
            ratio(m("async_repeat/zarrckpt", "blocked"), sync),
            0.10,
            False,
            "%",
            "async_repeat_call/zarrckpt",
        ),
        Target(
            "async save, staging='background', first call: blocked / sync save",
            ratio(m("async_first/zarrckpt-background", "blocked"), sync),
            0.05,  # issue 27
            False,
            "%",
            "async_first_call/zarrckpt-background",
        ),
        Target(
            "async save, staging='background', later calls: blocked / sync save",
            ratio(m("async_repeat/zarrckpt-background", "blocked"), sync),
            0.02,  # issue 27
            False,
            "%",
            "async_repeat_call/zarrckpt-background",
        ),
        *s3_targets(runs, lazy),
        *peer_targets(runs, info),
    ]


def section_local(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    nbytes = info["state_bytes"]
    out = [SECTIONS["local"][0], ""]
    raw = raw_limit(runs, "save")
    header = [*LIB_HEADER, RAW_SHARE] if raw is not None else LIB_HEADER
    out += _table(header, _lib_rows(runs, "save", ["zarrckpt", "tensorstore", "dcp", "raw", "raw8"], nbytes, raw))
    if raw is not None:
        out += ["", f"`{RAW_SHARE}` = the faster raw write's median time / the library's (1 = as fast as raw)."]
    if "tensorstore" in info.get("peers", {}):
        out += ["", *peer_lines({"peers": {"tensorstore": info["peers"]["tensorstore"]}}, "sections 1 and 2")]
    files = next((r["files"] for r in reversed(runs) if "files" in r), {})
    if files:
        out += ["", "Files written: " + ", ".join(f"{k} {v[0]} ({v[1]:,} bytes)" for k, v in files.items()) + "."]
    layout = next((r["layout"] for r in reversed(runs) if "layout" in r), [])
    if layout:
        big = max(layout, key=lambda t: t["bytes"])
        out.append(
            f"zarrckpt layout (read by the TensorStore writer), largest tensor `{big['key']}` {big['shape']}: "
            f"shard {big['shard']}, inner chunk {big['chunk']}."
        )
    out += ["", SECTIONS["local"][1], ""]
    out += _table(LIB_HEADER, _lib_rows(runs, "reshard", ["zarrckpt", "dcp", "tensorstore"], nbytes))
    out += [
        "",
        "TensorStore reads the arrays its save in section 1 wrote (zarrckpt's shard / chunk shapes): each of the "
        "3 ranks opens every array and copies its own rows straight into its target shard (a `ts.array` view of "
        "the tensor's memory); no raw read baseline.",
        "",
        "Read amplification = bytes the 3 ranks read from storage / bytes their target shards need "
        f"({nbytes:,}); bytes read = sum over ranks of the `rchar` delta of `/proc/self/io` (bytes passed to "
        "read/pread/preadv system calls, page-cache hits included; it also counts the few KB the "
        "collectives read from sockets).",
        "",
    ]
    rows = []
    for lib in ("zarrckpt", "dcp", "tensorstore"):
        rchar = median(runs, f"reshard/{lib}", "rchar")
        if rchar is not None:
            disk = median(runs, f"reshard/{lib}", "read_bytes") or 0
            rows.append([LIB_NAMES[lib], f"{rchar:,.0f}", f"{rchar / nbytes:.3f}", f"{disk:,.0f}"])
    out += _table(["library", "bytes read (rchar)", "read amplification", "from the block device (read_bytes)"], rows)
    return out


def section_async(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    out = [SECTIONS["async"][0], ""]
    sync = median(runs, "save/zarrckpt")
    out += [
        "Blocked = max over ranks of the duration of the `async_save` call (barrier before, none after). "
        "Total = from that call until every rank's future is done. `first`: the first call at this state's "
        "shapes in the process (zarrckpt allocates its host staging buffers); `repeat`: the next call, as a "
        "training loop checkpointing periodically makes it (zarrckpt reuses its staging buffers; DCP with its "
        f"default `FileSystemWriter` stages a fresh copy every time). Synchronous `zarrckpt.save` of the same "
        f"state: {_s(sync)} s.",
        "",
    ]
    out += [
        "`staging='background'` returns right after planning and copies on a staging thread; `staged` = from "
        "the call until `wait_staged()` returns on every rank (what a loop waiting before its optimizer step "
        "would wait for if it had nothing else to do). DCP's async stager (`DefaultStager(use_async_staging="
        "True)`) needs CUDA, so on this CPU box DCP is measured with its default staging.",
        "",
    ]
    apis = (
        ("zarrckpt", "zarrckpt.async_save"),
        ("zarrckpt-background", "zarrckpt.async_save(staging='background')"),
        ("dcp", "dcp.async_save (FileSystemWriter)"),
    )
    rows = []
    for call in ("first", "repeat"):
        for lib, api in apis:
            b, t = median(runs, f"async_{call}/{lib}", "blocked"), median(runs, f"async_{call}/{lib}", "total")
            staged = median(runs, f"async_{call}/{lib}", "staged")
            if b is not None:
                rows.append(
                    [f"{api}, {call}", f"{b:.3f}", _s(staged, "{:.3f}"), f"{t:.2f}", _s(ratio(b, sync), "{:.1%}")]
                )
    return out + _table(["call", "blocked s", "staged s", "total s", "blocked / sync zarrckpt save"], rows)


def section_rss(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    out = [SECTIONS["rss"][0], ""]
    out += [
        "Per rank, around each operation: `VmHWM` (peak RSS) is reset to the current RSS by writing `5` to "
        "`/proc/self/clear_refs` right before the call and read right after it. `peak` = max over ranks of "
        "VmHWM after the call (the rank's state or load target included); `extra` = max over ranks of that "
        "peak minus the RSS just before the call (what the operation itself needed on top).",
        "",
    ]
    rows = []
    for op in (
        "save",
        "reshard",
        "s3_save",
        "s3_reshard",
        "rgw_save",
        "rgw_reshard",
        "async_first_call",
        "async_repeat_call",
        *(f"many{w}_{op}" for w in info.get("many", {}).get("ranks", []) for op in ("save", "load")),
    ):
        for lib in LIB_NAMES:
            peak, extra = median(runs, f"{op}/{lib}", "rss_peak"), median(runs, f"{op}/{lib}", "rss_extra")
            if peak is not None and extra is not None:
                rows.append([op, LIB_NAMES[lib], f"{peak / MIB:,.0f}", f"{extra / MIB:,.0f}"])
    return out + _table(["operation", "library", "peak RSS MiB (max rank)", "extra MiB (max rank)"], rows, 2)


def render(runs: list[dict[str, Any]], lazy: dict[str, Any] | None, info: dict[str, Any]) -> str:
    ran = set(info["only"])
    goals = targets(runs, lazy, info)
    out = [
        f"# zarrckpt benchmark suite ({info['state_bytes'] / 2**30:.2f} GiB local, "
        f"{info['s3_state_bytes'] / MIB:.0f} MiB S3)",
        "",
    ]
    out += [f"- {line}" for line in info["about"]] + ["", "## Targets", ""]
    rows = []
    for t in goals:
        verdict = "not run" if t.ok is None else ("PASS" if t.ok else "MISS")
        cmp = ">=" if t.higher_is_better else "<="
        rows.append(
            [t.name, "n/a" if t.measured is None else t.fmt(t.measured), f"{cmp} {t.fmt(t.threshold)}", verdict]
        )
    out += _table(["target", "measured", "goal", "verdict"], rows)
    missed = [t for t in goals if t.ok is False]
    notes = {**MISS_NOTES, **peer_miss_notes(info)}
    if missed:
        out += ["", "### Misses", ""]
        for t in missed:
            out.append(f"- **{t.name}** ({t.fmt(t.measured or 0)}): {notes.get(t.name, NO_NOTE)}")
            prof = Path(info["profile"]) / f"{(t.profile or '').replace('/', '_')}.pstats" if info["profile"] else None
            if prof is not None and prof.exists():
                from common import top_functions

                top = ", ".join(f"`{f}` {s:.2f}s" for f, s in top_functions(prof))
                out.append(f"  - profile of rank 0 (CPU s, self time, all threads): {top}")
    body: list[tuple[str, Callable[[], list[str]]]] = [
        ("local", lambda: section_local(runs, info)),
        ("s3", lambda: section_s3(runs, info)),
        ("lazy", lambda: section_lazy(lazy, info)),
        ("async", lambda: section_async(runs, info)),
        ("rss", lambda: section_rss(runs, info)),
        ("many", lambda: section_many(runs, info)),
    ]
    for part, fn in body:
        out.append("")
        if part in ran or (part == "rss" and ran & {"local", "s3", "async", "many"}):
            out += fn()
        else:
            for title in SECTIONS[part]:
                out += [title, "", "_not run in this invocation (`--only`)._", ""]
    out += ["", "## GPU", "", info["gpu"], "", "## Charts", ""]
    out += [f"![{os.path.basename(path)}]({path})" for path in info.get("charts", [])]
    return "\n".join(out).rstrip() + "\n"
