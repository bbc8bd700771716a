"""The scale model's shortcut for the layout-based planner (benchmarks/scale_compact.py, issue 28) at 64 ranks.

At 16,384 ranks the scale model simulates only each stage's first rank in full and builds the other
ranks' splits from it plus their per-rank leaves; here every rank is simulated in full and the
splits must be the same, and the plan ``zarrckpt.plan.compact`` builds from them must be the one
``build_save_plan`` builds from every rank's description.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
from test_scale_plan import DIMS, SAVE, sm

from zarrckpt.plan import compact
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, build_save_plan

sc = importlib.import_module("scale_compact")  # benchmarks/: on sys.path once test_scale_plan loaded the scale model


def test_shortcut_splits_are_the_full_ones() -> None:
    full = sc.simulated_splits(DIMS, SAVE, range(SAVE.world))
    short = sc.simulated_splits(DIMS, SAVE, [0, SAVE.dp])
    assert [s.layouts for s in short] == [s.layouts for s in full]
    # the same items (their order differs; a rank's items are matched as a multiset, each key's parts in order)
    assert [sorted(map(compact.canon, s.plain)) for s in short] == [sorted(map(compact.canon, s.plain)) for s in full]
    assert len(compact.classes_of([s.digest() for s in full])) == SAVE.pp


def test_coordinator_plan_is_the_gathered_one() -> None:
    splits = sc.simulated_splits(DIMS, SAVE, range(SAVE.world))
    classes = compact.classes_of([s.digest() for s in splits])
    docs = [splits[m[0]].doc() for m in classes]
    leaders = [json.loads(d)["plain"] for d in docs]
    flags = [compact.my_flags(splits[r], leaders[i]) for i, m in enumerate(classes) for r in m[:1]]
    low = [f.copy() for f in flags]
    for i, m in enumerate(classes):
        for r in m:
            low[i] = low[i].clip(max=compact.my_flags(splits[r], leaders[i]))
    cdocs = compact.class_docs(classes, docs, np.concatenate(low))
    of = {r: i for i, m in enumerate(classes) for r in m}
    privates = [json.loads(compact.wire(compact.own_items(splits[r], cdocs[of[r]]))) for r in range(SAVE.world)]
    planned, payloads = compact.coordinate(cdocs, privates, SAVE.world, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)
    assert planned is not None
    plan = planned.plan
    want = build_save_plan(
        sm.decode(sm.gather_descriptions(DIMS, SAVE)), DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES
    )
    assert plan == want
    last = SAVE.world - 1
    mine = compact.local_plan(cdocs, payloads[last], last, SAVE.world, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)
    assert mine is not None and mine.blocks == planned.blocks
    got = mine.plan
    assert got.shards_of(last) == want.shards_of(last) and got.metadata_of(last) == want.metadata_of(last)
    assert len(got.arrays) < len(want.arrays) // SAVE.pp + SAVE.world  # its stage's tensors, not every stage's
