"""The report's parts about the other libraries (s3torchconnector, TensorStore) and scenario 7 (many
small tensors): their targets, their miss notes, section 7 and the one-line notes on peers that
could not run."""

from __future__ import annotations

from typing import Any

from tables import LIB_HEADER, LIB_NAMES, RAW_SHARE, Target, lib_rows, median, ratio, table

MANY_TITLE = "## 7. Many small tensors, local disk"
MANY_BUDGET_S = 5.0  # zarrckpt's save and load of the many-tensors state on 1 rank

_MANY_SAVE = (
    "an array per tensor is two objects (a shard and its `zarr.json`; the file counts are in section 7) in "
    "one directory (format version 4: chunk keys `c.0`, not a `c/` tree; a 20,001-tensor save made 49,173 "
    "directories before, 22,504 now). Since issue 39 the objects are created in place and made durable by "
    "one barrier per rank (`syncfs`) instead of a temporary file, fsync and link each; small ones are "
    "written on the saving thread while the filesystem answers fast (eight threads on 2 cores spent more "
    "passing the GIL than the system calls cost), and a `syncfs` every 64 MiB on another thread starts "
    "write-back while files are still being created (the barrier 1.06 s -> 0.21 s). This VM's root "
    "filesystem is ext4 mounted with `discard`: there a deleted tree's discards stall the creations after "
    "it (a save took 6.2-20.3 s; deleting a checkpoint's tree 10 s), which DCP's two files never meet. On "
    "an ext4 with default mount options (a loop-mounted image, `benchmarks/results/many_ext4.md`, "
    "2026-12-05) the save took 4.01-4.11 s on 1 rank (0.47x DCP's time) and 6.80-7.31 s on 4 (0.58x)."
)
_MANY_LOAD = (
    "per-tensor CPU: parsing the manifest (every array's document and commit record), planning a read per "
    "small shard and reading each (one `preadv` of index and chunk) on the loading thread; with 4 ranks, "
    "the 4 processes share 2 cores for the same per-tensor work each."
)
MISS_NOTES: dict[str, str] = {
    "save, local: zarrckpt speed / TensorStore": (
        "TensorStore writes the same arrays and bytes with the same shard and chunk shapes; it does not "
        "fsync each file (its `file_io_sync` default syncs on commit) and plans nothing collectively."
    ),
    "resharding load 4->3, local: zarrckpt speed / TensorStore": (
        "both read the same bytes from the page cache and check the same crc32c; TensorStore opens every "
        "array on every rank and plans nothing collectively."
    ),
    "S3 on RGW: save, zarrckpt speed / s3torchconnector": (
        "s3torchconnector writes DCP's layout (one object per rank, a few multipart uploads) with a Rust "
        "client: 51 requests against zarrckpt's 228, whose per-request client CPU (on 2 cores shared by "
        "4 ranks and the gateway) weighs. The larger cost is zarrckpt's end-to-end check of each PUT: an MD5 "
        "of every body (0.09 s per 64 MiB rank, against 0.004 s for crc32c) compared with the ETag; "
        "`benchmarks/s3_floor.py` measured 1.03x with it and 1.35x with it patched off (15 repetitions, "
        "2026-12-05). Its requests go through `etagproxy.py` (Python), which costs it CPU too."
    ),
    "S3 on moto: resharding load, zarrckpt speed / s3torchconnector": (
        "moto's per-request CPU (in the driver process) bounds both; s3torchconnector makes fewer, larger "
        "ranged GETs (its DCP-optimized reader coalesces the ranges of each rank's file)."
    ),
    "S3 on RGW: resharding load, zarrckpt speed / s3torchconnector": (
        "requests per byte on a client-CPU-bound box: zarrckpt's 214 GETs read 1.09x the state, "
        "s3torchconnector's 51 read 1.50x (its reader coalesces each rank's ranges)."
    ),
}


def many_ops(info: dict[str, Any]) -> list[int]:
    return list(info.get("many", {}).get("ranks", [1, 4]))


def _many_name(world: int) -> str:
    return f"many tensors, {world} rank{'s' if world > 1 else ''}"


def peer_targets(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[Target]:
    def m(name: str) -> float | None:
        return median(runs, name)

    def speedup(op: str, other: str) -> float | None:
        return ratio(m(f"{op}/{other}"), m(f"{op}/zarrckpt"))

    out = [
        Target("save, local: zarrckpt speed / TensorStore", speedup("save", "tensorstore"), 1.2, True, "x"),
        Target(
            "resharding load 4->3, local: zarrckpt speed / TensorStore",
            speedup("reshard", "tensorstore"),
            1.2,
            True,
            "x",
            "reshard/zarrckpt",
        ),
        Target("S3 on RGW: save, zarrckpt speed / s3torchconnector", speedup("rgw_save", "s3tc"), 1.2, True, "x"),
        Target(
            "S3 on moto: resharding load, zarrckpt speed / s3torchconnector",
            speedup("s3_reshard", "s3tc"),
            1.5,
            True,
            "x",
        ),
        Target(
            "S3 on RGW: resharding load, zarrckpt speed / s3torchconnector",
            speedup("rgw_reshard", "s3tc"),
            1.5,
            True,
            "x",
        ),
    ]
    for world in many_ops(info):
        name = _many_name(world)
        for op in ("save", "load"):
            key = f"many{world}_{op}"
            out.append(
                Target(
                    f"{name}: {op}, zarrckpt time / DCP",
                    ratio(m(f"{key}/zarrckpt"), m(f"{key}/dcp")),
                    1.0,
                    False,
                    "x",
                    f"{key}/zarrckpt",
                )
            )
            if world == 1:
                out.append(
                    Target(
                        f"{name}: {op}, zarrckpt time",
                        m(f"{key}/zarrckpt"),
                        MANY_BUDGET_S,
                        False,
                        "s",
                        f"{key}/zarrckpt",
                    )
                )
    return out


def peer_miss_notes(info: dict[str, Any]) -> dict[str, str]:
    notes = dict(MISS_NOTES)
    for world in many_ops(info):
        for op in ("save", "load"):
            note = _MANY_SAVE if op == "save" else _MANY_LOAD
            notes[f"{_many_name(world)}: {op}, zarrckpt time / DCP"] = note
            notes[f"{_many_name(world)}: {op}, zarrckpt time"] = note
    return notes


def peer_lines(info: dict[str, Any], where: str) -> list[str]:
    """One line per peer library that did not run, saying why (``where``: the scenario)."""
    return [f"- {LIB_NAMES.get(lib, lib)}: not run in {where}: {why}." for lib, why in info.get("peers", {}).items()]


def section_many(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    many = info.get("many", {})
    out = [MANY_TITLE, ""]
    out += [
        f"{many.get('tensors', '?'):,} small float32 tensors of 1-64 KiB each (1-D, sizes from `random.Random(27)`, "
        f"data from one seeded `torch.randn`) plus one {many.get('big_mib', '?')} MiB float32 tensor [rows, 1024]. "
        "Layout, as an FSDP / DDP state holds them: the large tensor is a `Shard(0)` DTensor over the ranks; the "
        "small ones are plain tensors, the same on every rank (replicated, like norm weights and biases: each "
        "library writes each of them once). Save: `zarrckpt.save` vs `dcp.save(FileSystemWriter)` (both fsync), "
        "then the raw limit: each rank writes its share of the unique bytes (its shard, every world-th small "
        "tensor) to one file and fsyncs it; and the per-object floor of an array per tensor: the same share, "
        "each tensor as two files (its data and 700 bytes, as a shard and a `zarr.json`), each fsync'd, 8 in "
        "flight. Load: into a zeroed state of the same layout and world size, "
        "`zarrckpt.load` vs `dcp.load(FileSystemReader)`, every tensor then checked bit for bit (crc32c against "
        f"the saved data). Targets: zarrckpt's time <= DCP's, and <= {MANY_BUDGET_S:.0f} s on 1 rank.",
        "",
    ]
    for world in many_ops(info):
        state = next((r[f"many{world}_state"] for r in reversed(runs) if f"many{world}_state" in r), None)
        if state is None:
            continue
        nbytes = state["bytes"]
        out += [f"**{world} rank{'s' if world > 1 else ''}** ({state['tensors']:,} tensors, {nbytes:,} bytes)", ""]
        raw = median(runs, f"many{world}_save/raw")
        rows = [
            [f"save: {r[0]}", *r[1:]]
            for r in lib_rows(runs, f"many{world}_save", ["zarrckpt", "dcp", "raw", "raw-files"], nbytes, raw)
        ]
        rows += [[f"load: {r[0]}", *r[1:]] for r in lib_rows(runs, f"many{world}_load", ["zarrckpt", "dcp"], nbytes)]
        for row in rows[len(rows) - 2 :] if raw is not None else []:
            row.append("")  # the raw limit is a write; no share for the loads
        header = [*LIB_HEADER, RAW_SHARE] if raw is not None else LIB_HEADER
        out += table(header, rows)
        files = next((r[f"many{world}_files"] for r in reversed(runs) if f"many{world}_files" in r), {})
        if files:
            said = ", ".join(f"{LIB_NAMES.get(k, k)} {v[0]:,} ({v[1]:,} bytes)" for k, v in files.items())
            out += ["", f"Files written: {said}."]
        out.append("")
    return out


def s3_peer_text(info: dict[str, Any]) -> list[str]:
    """What section 3 says about the peers on S3."""
    out = [
        "Peers on S3: **s3torchconnector** 1.x (`S3StorageWriter` / `S3StorageReader` with `dcp.save` / "
        "`dcp.load`; Mountpoint's Rust client, path-style, keys from the environment; those classes take no "
        "endpoint, so the benchmark hands their `S3FileSystem` an `S3Client(region, endpoint=...)`); on RGW through "
        "`etagproxy.py`, a loopback proxy that fills in the ETag radosgw 16.2 leaves empty in its "
        'CompleteMultipartUpload answer (without it every save fails: `Header "ETag" not found`); its CPU is '
        "in the driver process. **TensorStore** zarr3 on its `s3` kvstore (endpoint, region, keys from the "
        "environment): the same arrays with zarrckpt's shard / chunk shapes, each rank writing and reading its "
        "own region; it runs after zarrckpt (it copies the layout of zarrckpt's checkpoint), the other three "
        "alternate.",
    ]
    lines = peer_lines(info, "the S3 scenarios")
    for name, store in info.get("stores", {}).items():
        short = {"s3": "moto", "rgw": "RGW"}.get(name, name)
        lines += [
            f"- {LIB_NAMES.get(lib, lib)}: not run on {short}: {why}." for lib, why in store.get("skip", {}).items()
        ]
    return [*out, *(["", *lines] if lines else [])]
