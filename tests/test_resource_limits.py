"""Crafted metadata cannot exhaust memory or CPU: buffers are sized from the objects' real lengths,
chunk and shard counts are checked against ceilings (and against the commit record's real bytes)
before any loop, and ``verify()`` reports what it finds instead of raising ``MemoryError``.

Each crafted checkpoint is a real 4-element save whose manifest (and the array's own ``zarr.json``)
then claims another layout, without a commit record to back it (the record would have to be as large
as the claim, so with one the claim is paid for in real bytes). "Quickly" is counted in Python steps
(calls and lines), which does not depend on the machine's load; memory by an address-space limit of
2 GiB on a process of its own, and by tracemalloc's peak in the fuzz test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.errors import ZarrckptError
from zarrckpt.format.array import MAX_CHUNKS_PER_SHARD, MAX_UNRECORDED_SLOTS

STEPS = 200_000  # Python steps an operation on a crafted checkpoint may take (a valid 4-element one: ~20,000)
GIB = 2**30

# name -> (shape, shard shape, inner chunk shape, bytes to replace the one shard object with, or None)
CRAFTED: dict[str, tuple[list[int], list[int], list[int], int | None]] = {
    "one 16 GiB chunk in a 24-byte shard": ([4 * GIB], [4 * GIB], [4 * GIB], 24),
    "2**26 one-element chunks in a shard": ([2**26], [2**26], [1], None),
    "2**26 one-element shards": ([2**26], [1], [1], None),
    "2**40 one-element shards": ([2**40], [1], [1], None),
    "2**40 one-element chunks in a shard": ([2**40], [2**40], [1], None),
    "2**20 chunks in a shard, no record": ([2**20], [2**20], [1], 24),
    "the most shards without a record": ([MAX_UNRECORDED_SLOTS], [1], [1], None),
    "one shard more than that": ([MAX_UNRECORDED_SLOTS + 1], [1], [1], None),
}


def craft(url: Path, shape: list[int], shard: list[int], chunk: list[int], shard_bytes: int | None) -> None:
    zarrckpt.save({"v": torch.arange(4.0), "step": 1}, url)
    doc = json.loads((url / "zarr.json").read_text())
    node = doc["consolidated_metadata"]["metadata"]["v"]
    node["shape"] = shape
    node["chunk_grid"]["configuration"]["chunk_shape"] = shard
    node["codecs"][0]["configuration"]["chunk_shape"] = chunk
    del doc["attributes"]["zarrckpt"]["integrity"], doc["attributes"]["zarrckpt"]["attributes_crc32c"]
    (url / "zarr.json").write_text(json.dumps(doc))
    own = json.loads((url / "v" / "zarr.json").read_text())
    own.update({k: node[k] for k in ("shape", "chunk_grid", "codecs")})
    (url / "v" / "zarr.json").write_text(json.dumps(own))
    if shard_bytes is not None:
        (url / "v" / "c.0").write_bytes(os.urandom(shard_bytes))


# Run in a process of its own under RLIMIT_AS: each operation, its outcome, and the Python steps it took.
_RUNNER = """
import json, resource, sys
import torch, zarrckpt, zarrckpt.tensorview, zarrckpt.convert.export  # imported before the limit and the count
from zarrckpt.cli import commands
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
OPS = {
    "open": lambda url: len(zarrckpt.open(url)),
    "view": lambda url: zarrckpt.open(url)["v"][0],
    "verify": lambda url: zarrckpt.open(url).verify()["problems"],
    "info": lambda url: commands.main(["info", url]),
    "export": lambda url: zarrckpt.export_safetensors(url, url + "-out"),
}
out = {}
for url in sys.argv[1:]:
    for name, op in OPS.items():
        steps = 0
        def tracer(frame, event, arg):
            global steps
            steps += 1
            return tracer
        sys.settrace(tracer)
        try:
            result = op(url)
            outcome = ["ok", result if isinstance(result, (int, list)) else None]
        except zarrckpt.ZarrckptError as e:
            outcome = ["ZarrckptError", str(e)[:300]]
        except BaseException as e:
            outcome = [type(e).__name__, str(e)[:300]]
        finally:
            sys.settrace(None)
        out[f"{url} {name}"] = outcome + [steps]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_crafted_checkpoints_end_quickly_with_a_clear_error_under_2_gib(tmp_path: Path) -> None:
    urls = {}
    for n, (name, (shape, shard, chunk, nbytes)) in enumerate(CRAFTED.items()):
        urls[name] = tmp_path / f"c{n}"
        craft(urls[name], shape, shard, chunk, nbytes)
    env = {**os.environ, "PYTHONPATH": str(Path(zarrckpt.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *map(str, urls.values())], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, url in urls.items():
        for op in ("open", "view", "verify", "info", "export"):
            outcome, detail, steps = results[f"{url} {op}"]
            where = f"{name}: {op}"
            assert steps <= STEPS, f"{where} took {steps} Python steps"
            if op == "info":  # the command: a clear message and exit status 3, or the summary
                assert outcome == "ok" and detail in (0, 3), (where, outcome, detail)
            elif op == "open" and outcome == "ok":  # metadata that only the objects contradict
                assert CRAFTED[name][3] is not None or name == "the most shards without a record", where
            elif op == "verify" and outcome == "ok":  # opened: it reports, it does not raise
                assert detail, f"{where}: verify found no problem"
            else:
                assert outcome == "ZarrckptError", (where, outcome, detail)
    assert "truncated: 24 bytes" in str(results[f"{urls['one 16 GiB chunk in a 24-byte shard']} verify"][1])


def test_verify_names_every_chunk_a_truncated_shard_lacks(tmp_path: Path) -> None:
    """8 inner chunks of 4 rows; the object cut inside chunk 3: chunks 3..7 are named, with the real length."""
    url = tmp_path / "ck"
    zarrckpt.save({"w": torch.arange(32 * 8.0).reshape(32, 8)}, url, chunk_bytes=4 * 8 * 4)
    path = url / "w" / "c.0.0"
    raw = path.read_bytes()
    head, chunk = 16 * 8 + 4, 4 * 8 * 4 + 4
    path.write_bytes(raw[: head + 3 * chunk + 10])
    (problem,) = zarrckpt.open(url).verify()["problems"]
    assert f"truncated: {head + 3 * chunk + 10} bytes of {len(raw)}" in problem
    assert "5 of its 8 inner chunks lie past its end: [3, 0], [4, 0], [5, 0], [6, 0], [7, 0]" in problem


def test_verify_counts_missing_shards_and_names_stray_objects(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    parts = [zarrckpt.LocalShard(torch.full((2, 4), float(i)), (8, 4), (2 * i, 0)) for i in range(4)]
    zarrckpt.save({"w": parts}, url, small_tensor_bytes=0)
    (url / "w" / "c.1.0").unlink()
    (url / "w" / "c.3.0").unlink()
    (url / "w" / "c.9").write_bytes(b"x")
    (problem,) = zarrckpt.open(url).verify()["problems"]
    assert "2 of 4 shard objects of 'w' are missing: w/c.1.0, w/c.3.0" in problem
    assert "1 object(s) under" in problem and "'w/c.9'" in problem


def test_a_save_beyond_the_ceilings_is_refused_before_writing(tmp_path: Path) -> None:
    """zarrckpt never writes what its readers would refuse: 2**20 + 1 inner chunks in one shard."""
    with pytest.raises(zarrckpt.SaveLayoutError, match=r"inner chunks per shard.*chunk_bytes"):
        zarrckpt.save({"w": torch.zeros(MAX_CHUNKS_PER_SHARD + 1, dtype=torch.uint8)}, tmp_path / "ck", chunk_bytes=1)
    assert not (tmp_path / "ck").exists()


# -- fuzz: layout fields and shard-index entries, through open, a view and verify ------------------------
LAYOUT_INTS = st.one_of(st.integers(1, 64), st.sampled_from([2**20, 2**26, 2**31, 2**40, 2**62]))


def _bounded(fn: Any) -> Any:
    """``fn()``: a ZarrckptError or a result, in bounded Python steps and bounded memory."""
    steps = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        return tracer

    tracemalloc.start()
    sys.settrace(tracer)
    try:
        return fn()
    except ZarrckptError as e:
        return e
    finally:
        sys.settrace(None)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert steps <= STEPS, f"{steps} steps"
        assert peak < 256 * 2**20, f"{peak} bytes at the peak"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=LAYOUT_INTS,
    shard=LAYOUT_INTS,
    chunk=LAYOUT_INTS,
    entry=st.tuples(st.sampled_from([0, 20, 36, 2**40, 2**64 - 1]), st.sampled_from([0, 20, 24, 2**40, 2**64 - 1])),
)
def test_fuzz_layouts_and_index_entries(tmp_path_factory: Any, shape: int, shard: int, chunk: int, entry: Any) -> None:
    url = tmp_path_factory.mktemp("fuzz") / "ck"
    zarrckpt.save({"v": torch.arange(4.0)}, url)
    index = np.array([entry], dtype="<u8").tobytes()
    import crc32c

    (url / "v" / "c.0").write_bytes(index + crc32c.crc32c(index).to_bytes(4, "little") + bytes(20))
    doc = json.loads((url / "zarr.json").read_text())
    node = doc["consolidated_metadata"]["metadata"]["v"]
    node["shape"], node["chunk_grid"]["configuration"]["chunk_shape"] = [shape], [min(shard, shape)]
    node["codecs"][0]["configuration"]["chunk_shape"] = [chunk]
    del doc["attributes"]["zarrckpt"]["integrity"], doc["attributes"]["zarrckpt"]["attributes_crc32c"]
    (url / "zarr.json").write_text(json.dumps(doc))
    opened = _bounded(lambda: zarrckpt.open(url))
    if isinstance(opened, ZarrckptError):
        return
    _bounded(lambda: opened["v"][0])
    _bounded(lambda: opened["v"][-1])
    summary = _bounded(lambda: opened.verify())
    assert isinstance(summary, ZarrckptError) or isinstance(summary["problems"], list)
    if not isinstance(summary, ZarrckptError) and (shape, min(shard, shape), chunk) != (4, 4, 4):
        assert summary["problems"], "a layout the objects do not have verified clean"
