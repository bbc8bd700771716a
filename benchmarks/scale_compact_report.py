"""scale.md's issue-28 section: the layout-based planner at 1,024 / 4,096 / 16,384 simulated ranks, and
the loads of the 16,384-rank checkpoint at 8,192 and 24,576 ranks (``scale_compact.py`` measures them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scale_report import _mb, _table, verdict

BEGIN, END = "<!-- issue 28: begin -->", "<!-- issue 28: end -->"


def splice(page: str, section: str) -> str:
    """``page`` with its issue-28 section replaced by ``section`` (appended when it has none)."""
    if BEGIN in page and END in page:
        return page[: page.index(BEGIN)] + section + page[page.index(END) + len(END) :]
    return page.rstrip("\n") + "\n\n" + section + "\n"


def render_compact(rs: Sequence[Any]) -> str:
    """The section of scale.md comparing the layout-based planner across scales, with DCP and targets."""
    cols = [f"{r.world:,} ranks" for r in rs]
    big = rs[-1]
    per_rank = {r.world: sum(r.received.values()) for r in rs}
    rows = [
        ["classes of ranks (distinct DTensor layouts: pipeline stages)", *(f"{r.classes}" for r in rs)],
        ["fell back to gathering descriptions", *("yes" if r.fallback else "no" for r in rs)],
        ["**per-rank planning (rank `world - 1`)**", *(f"**{r.typical}**" for r in rs)],
        ["**coordinator planning (rank 0: whole plan + every rank's payload)**", *(f"**{r.coordinator}**" for r in rs)],
        ["manifest build (`Manifest(...).dumps()`, rank 0)", *(str(r.manifest_t) for r in rs)],
        *([k, *(_mb(r.received[k]) for r in rs)] for k in rs[0].received),
        ["**received per rank, in all**", *(f"**{_mb(per_rank[r.world])}**" for r in rs)],
        ["received by the coordinator (+ every rank's per-rank items)", *(_mb(r.coordinator_received) for r in rs)],
        ["today's all-gather of descriptions: received per rank", *(_mb(r.gather_received) for r in rs)],
        ["DCP: per rank, its local plan scattered back (pickle)", *(_mb(r.dcp_plan_bytes) for r in rs)],
        ["DCP: coordinator gathers every local plan", *(_mb(r.dcp_plan_bytes * r.world) for r in rs)],
        ["manifest (one GET per job; all `zarrckpt.open` downloads)", *(_mb(r.manifest_bytes) for r in rs)],
        *([f"- {k}", *(_mb(r.manifest_parts[k]) for r in rs)] for k in rs[0].manifest_parts),
        ["chunk checksum table (`.zarrckpt-crc32c`: one GET per load)", *(_mb(r.table_bytes) for r in rs)],
        [
            "manifest parse and the table attached (every loading rank, before planning)",
            *(str(r.manifest_parse) for r in rs),
        ],
        ["resident memory of the parsed manifest and table, per loading rank", *(_mb(r.resident) for r in rs)],
        ["arrays", *(f"{r.arrays:,}" for r in rs)],
        ["shard objects", *(f"{r.shard_objects:,}" for r in rs)],
        ["PUT requests per save", *(f"{r.puts:,}" for r in rs)],
        ["(simulation) building the ranks' splits", *(f"{r.gen_s:.0f} s" for r in rs)],
    ]
    w = f"{big.world:,}"
    loads = big.loads
    worst = max((x.parse.wall + x.planning.wall for x in loads), default=None)
    load_measured = (
        "; ".join(f"{x.name}: {x.parse.wall + x.planning.wall:.2f} s" for x in loads) if loads else "not measured"
    )
    targets_ = [
        [f"per-rank save planning <= 2 s at {w}", str(big.typical), verdict(big.typical.wall <= 2)],
        [f"received per rank <= 4 MB at {w}", _mb(per_rank[big.world]), verdict(per_rank[big.world] <= 4e6)],
        [f"coordinator <= 10 s at {w}", str(big.coordinator), verdict(big.coordinator.wall <= 10)],
        [f"manifest <= 8 MB at {w} (one GET per job)", _mb(big.manifest_bytes), verdict(big.manifest_bytes <= 8e6)],
        [f"objects a load fetches before the data <= 2 at {w}", "2 (the manifest, the table)", "PASS"],
        [
            f"parsing <= 0.5 s per loading rank at {w}",
            str(big.manifest_parse),
            verdict(big.manifest_parse.wall <= 0.5),
        ],
        [f"resident <= 200 MB per loading rank at {w}", _mb(big.resident), verdict(big.resident <= 200e6)],
        [f"`open()` downloads <= 8 MB at {w}", _mb(big.manifest_bytes), verdict(big.manifest_bytes <= 8e6)],
        [
            "load planning (shrink to 8,192, grow to 24,576) <= 3 s per rank",
            load_measured,
            verdict(worst is not None and worst <= 3),
        ],
        [
            "checkpoint bit-identical to the gathering planner's",
            "`tests/test_plan_compact.py` (4 gloo ranks, both planners, every object compared)",
            "PASS",
        ],
    ]
    return "\n".join(
        [
            BEGIN,
            "## Planning from layouts at 1,024 / 4,096 / 16,384 ranks (issue 28)",
            "",
            "`python benchmarks/scale_model.py --compact-scales 1024,4096,16384`. Layouts: 1,024 = PP 8 x DP 128 "
            "(EP-MP 64 x EP-DP 2), 4,096 = PP 8 x DP 512 (EP-MP 64 x EP-DP 8), 16,384 = PP 16 x DP 1,024 "
            "(EP-MP 128 x EP-DP 8); same model and state as above. The save is planned by "
            "`zarrckpt.plan.compact` (what `zarrckpt.save` runs on more than one rank): a 16-byte digest "
            "all-gather of each rank's DTensor layouts groups ranks into classes; each class's lowest rank "
            "broadcasts its document (layouts, plain tensors, values); one MIN all-reduce of one flag per "
            "document item finds the items every member holds; items of single ranks go to rank 0 only, which "
            "builds the whole plan and scatters each rank its `zarr.json` share, its own items' arrays, its class's "
            "writers of joined and replicated shards and the numbers of its replicated blocks; every rank derives "
            "the boxes of its class's "
            "tensors from the layouts (`zarrckpt.plan.meshlayout`) and plans those tensors only (the ranks of other "
            "classes holding the same key included). Per-rank state (RNG states, the data-loader position) is "
            "`zarrckpt.PerRank` arrays `[world, ...]` (issue 40): one layout on every rank, like a DTensor's, so it "
            "neither splits classes nor reaches rank 0. Times are medians; received bytes count what each "
            "collective delivers to a rank "
            "(an all-reduce's result once; a ring moves about twice that over the wire).",
            "",
            "Simulation: each stage's first rank and the last rank are simulated in full (meta DTensors under "
            "the fake process group, `collect`, `compact.split`); the other ranks' splits are their stage "
            "leader's layouts and common items plus their own per-rank leaves (RNG state, data-loader "
            "position) collected for real -- building 16,384 full state dicts would take ~10 minutes here "
            "and gives the same splits (checked at 64 ranks by `tests/test_plan_scale_compact.py`). "
            "The coordinator and rank `world - 1` then run the real protocol functions on them.",
            "",
            *_table(["", *cols], rows),
            "",
            *_load_lines(loads, w),
            "### Targets (issue 28)",
            "",
            *_table(["target", "measured", ""], targets_),
            "",
            "### What still gathers, and what it costs",
            "",
            "- Per-rank state here is 3 `PerRank` arrays (2 RNG states and the data-loader position), a row per "
            f"rank: 3 of the {big.arrays:,} arrays at {w}, and nothing the coordinator gathers (it receives "
            f"{_mb(big.coordinator_received)} at {w}, every rank's items included). State saved under a key per "
            "rank instead is an array or value per rank, each with its `zarr.json` and groups in the manifest, "
            'gathered to rank 0 (docs/functions.md, "Per-rank state").',
            "- The manifest: the crc32c of every inner chunk (so a partial read checks what it reads against the "
            "commit) is in the chunk checksum table beside it since format version 3 (issue 40), 4 bytes a chunk; "
            "the manifest keeps each array's segment of it (offset, size, crc32c). A load reads the table once "
            "(rank 0, broadcast); a lazy read fetches its tensor's segment beside its first data GET, one round "
            "trip. The consolidated metadata is a full `zarr.json` per array, which zarr-python and xarray read; "
            "with per-rank state stacked into `PerRank` arrays it no longer grows with the world.",
            "- Tensors whose boxes no layout gives -- `LocalShard` lists, ShardedTensor shards, DTensors with "
            "`_StridedShard` placements, plain tensors held by some but not all ranks of a class -- are per-rank "
            "items, sent to rank 0 with their boxes. When such a key is also held as a class item, or is "
            "replicated or joined as small shards, the plan could differ between ranks: every rank then falls "
            "back to today's all-gather of descriptions (the whole description, `O(world)` bytes per rank). "
            "So does a job with more than 256 classes (e.g. every rank its own DTensor layout).",
            "- A rank plans the tensors of its class only, but with every holder of each (the ranks of its "
            "class, 1,024 at 16,384): its planning grows with the size of its class, not of the job.",
            "- Load: every loading rank parses the whole manifest (all arrays' metadata and commit records) and "
            f"takes its arrays' segments of the table, most of its planning at {w} ranks; "
            "the same code measured about twice as long on a slower VM in another session. "
            "A load fans out only under a million requests in all "
            "(`zarrckpt.engine.fanread.MAX_GATHERED_REQUESTS`): its planning gathers every rank's requests, so "
            "at these sizes each rank reads what it needs, and replicated regions (none in these layouts: "
            "every tensor is sharded) are read once per holder. Per-rank fan-out planning from the target "
            "layouts (as the save side plans) is not built.",
            END,
        ]
    )


def _load_lines(loads: Sequence[Any], w: str) -> list[str]:
    """The loads of the largest checkpoint: one column per target world size."""
    if not loads:
        return []
    rows = [
        ["ranks loading", *(f"{x.world:,}" for x in loads)],
        ["manifest parse and the table attached", *(str(x.parse) for x in loads)],
        ["matching, flags, read requests and their fetch plans", *(str(x.planning) for x in loads)],
        ["**load planning per rank, in all**", *(f"**{x.parse.wall + x.planning.wall:.2f} s**" for x in loads)],
        ["read requests / shard objects of the rank", *(f"{x.requests:,} / {x.fetches:,}" for x in loads)],
        [
            "fanned out (under a million requests in all; its planning over every rank's requests not timed here)",
            *("yes" if x.fanned_out else "no" for x in loads),
        ],
        *([k, *(_mb(x.received[k]) for x in loads)] for k in loads[0].received),
        ["**received per rank, in all**", *(f"**{_mb(sum(x.received.values()))}**" for x in loads)],
    ]
    return [
        f"### Loading the {w}-rank checkpoint at other world sizes",
        "",
        "The last rank of each target layout (state built in full: meta DTensors under the fake process group) "
        "runs what `zarrckpt.load` runs before its first read: it parses the manifest rank 0 broadcast, matches "
        "its target, makes its flags and view for the agreement (one MIN all-reduce of a flag per saved key; "
        "views as digests plus each distinct view once, or gathered whole past 256 distinct ones; per-rank "
        "state is `PerRank` arrays, so every rank asks for the same keys, each rank row `rank % saved world` "
        'with `per_rank="modulo"`), and plans its reads on an object store. '
        "Shrink: PP 16 x DP 512 (EP-MP 128 x EP-DP 4); grow: PP 16 x DP 1,536 (EP-MP 128 x EP-DP 12).",
        "",
        *_table(["", *(x.name for x in loads)], rows),
        "",
    ]
