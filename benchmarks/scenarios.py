"""What the rank processes of ``run.py`` do: one function per spawn (``save_phase``, ``load_phase``,
``lazy_phase``), each called as ``fn(rank, world, cfg)`` by ``zarrckpt.testing.spawn``.

Every operation goes through :func:`common.measure` (barrier, call, barrier; time, peak RSS and
``/proc/self/io`` deltas agreed over ranks). Rank 0 writes the results to ``cfg["result"]``
as JSON: ``{"<op>/<library>": measurement, ...}``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import build_specs_state, build_state, disk_usage, evict_page_cache, leaves, measure, verify
from scenarios_peers import (
    S3TC,
    file_kvstore,
    s3_kvstore,
    s3tc_loader,
    s3tc_saver,
    tensorstore_reader,
    tensorstore_writer,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.device_mesh import init_device_mesh

import zarrckpt

SAVERS = ("zarrckpt", "tensorstore", "dcp", "raw", "raw8")  # local save; repetition r starts at SAVERS[r % 5]
LIBS = ("zarrckpt", "dcp")
S3_LIBS = (*LIBS, S3TC, "tensorstore")  # on S3: DCP through s3fs, and through s3torchconnector
RESHARD_LIBS = (*LIBS, "tensorstore")  # local resharding load
BACKGROUND = "zarrckpt-background"  # async_save(..., staging="background")
ASYNC_LIBS = (*LIBS, BACKGROUND)


def lazy_specs(shape: tuple[int, ...]) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """The lazy-read scenario's state: three expert weight tensors of ``shape`` (the first is read)."""
    return [(("model", f"layers.0.moe.experts.{w}"), shape) for w in ("w1", "w2", "w3")]


# -- one operation per library -----------------------------------------------------------------


def saver(lib: str, state: dict[str, Any], url: str, opts: dict[str, Any] | None) -> Callable[[], None]:
    """``save`` with ``lib`` to ``url`` (``opts``: fsspec storage options, None on local disk)."""
    if lib == "zarrckpt":
        return lambda: zarrckpt.save(state, url, storage_options=opts)
    if opts is None:  # DCP's defaults, as users get them: one file per rank, fsync'd
        return lambda: dcp.save(state, storage_writer=FileSystemWriter(url))
    # sync_files=False: on an fsspec stream DCP's fsync falls back to os.sync(), which flushes
    # every local disk of the machine and has nothing to do with the object store
    return lambda: dcp.save(state, storage_writer=FsspecWriter(url, sync_files=False, **opts))


def loader(lib: str, state: dict[str, Any], url: str, opts: dict[str, Any] | None) -> Callable[[], None]:
    if lib == "zarrckpt":
        return lambda: zarrckpt.load(state, url, storage_options=opts)
    if opts is None:
        return lambda: dcp.load(state, storage_reader=FileSystemReader(url))
    return lambda: dcp.load(state, storage_reader=FsspecReader(url, **opts))


def s3_libs(cfg: dict[str, Any], store: dict[str, Any]) -> list[str]:
    """The libraries measured on ``store`` (the peers the driver found runnable, less those that cannot
    run on that server), in the order of repetition ``cfg["rep"]``: zarrckpt, DCP and s3torchconnector
    alternate; TensorStore comes last (it copies the layout of zarrckpt's checkpoint)."""
    wanted = [lib for lib in cfg.get("s3_libs", LIBS) if lib not in store.get("skip", {})]
    libs = [lib for lib in wanted if lib != "tensorstore"]
    libs = libs if cfg["rep"] % 2 == 0 else libs[::-1]
    return libs + (["tensorstore"] if "tensorstore" in wanted else [])


def s3_saver(lib: str, state: dict[str, Any], url: str, store: dict[str, Any]) -> Callable[[], None]:
    """``save`` with ``lib`` to ``url`` on ``store`` (``cfg["stores"]``): zarrckpt, DCP + s3fs, a peer."""
    if lib == S3TC:
        return s3tc_saver(state, url, store)
    if lib == "tensorstore":
        layout = zarrckpt.open(f"{url.rsplit('/', 1)[0]}/zarrckpt", storage_options=store["opts"]).tensors()
        return tensorstore_writer(state, s3_kvstore(url, store), layout)
    return saver(lib, state, url, store["opts"])


def s3_loader(lib: str, state: dict[str, Any], url: str, store: dict[str, Any]) -> Callable[[], None]:
    if lib == S3TC:
        return s3tc_loader(state, url, store)
    if lib == "tensorstore":
        return tensorstore_reader(state, s3_kvstore(url, store))
    return loader(lib, state, url, store["opts"])


BLOCK = 4 << 20  # raw writes go in blocks of this size (as ``dd bs=4M``; zarrckpt writes 4 MiB chunks too)


def _write_blocks(f: Any, t: Any) -> None:
    view = t.numpy().data.cast("B")
    for i in range(0, len(view), BLOCK):
        f.write(view[i : i + BLOCK])


def raw_writer(state: dict[str, Any], root: Path) -> Callable[[], None]:
    """Each rank writes the bytes of its local shards to one file, sequentially, then fsyncs it."""

    def write() -> None:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"rank{dist.get_rank()}.bin", "wb") as f:
            for t in leaves(state):
                _write_blocks(f, t)
            f.flush()
            os.fsync(f.fileno())

    return write


def raw_parallel_writer(state: dict[str, Any], root: Path, threads: int = 8) -> Callable[[], None]:
    """Each rank writes each local shard to its own file, ``threads`` at a time, each fsync'd
    (zarrckpt's write pattern without the encoding and metadata: more I/O in flight)."""

    def one(item: tuple[int, Any]) -> None:
        i, t = item
        with open(root / f"rank{dist.get_rank()}-{i}.bin", "wb") as f:
            _write_blocks(f, t)
            f.flush()
            os.fsync(f.fileno())

    def write() -> None:
        root.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, enumerate(leaves(state))))

    return write


_DCP_ASYNC_GROUP: list[Any] = []


def async_saver(lib: str, state: dict[str, Any], url: str, holder: list[Future[Any]]) -> Callable[[], None]:
    if lib == "zarrckpt":  # creates its own gloo group for the background collectives (first call)
        return lambda: holder.append(zarrckpt.async_save(state, url))
    if lib == BACKGROUND:  # returns after planning; the copy runs on a staging thread
        return lambda: holder.append(zarrckpt.async_save(state, url, staging="background"))
    # DCP's background thread runs collectives on ``process_group``; on the default group they would
    # interleave with the caller's (deadlock). A separate gloo group, created once, as DCP recommends.
    if not _DCP_ASYNC_GROUP:
        _DCP_ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    group = _DCP_ASYNC_GROUP[0]
    return lambda: holder.append(dcp.async_save(state, storage_writer=FileSystemWriter(url), process_group=group))


# -- the spawns --------------------------------------------------------------------------------


class Phase:
    """State shared by one spawn's operations: config, results, profile target, cleanup."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any], name: str) -> None:
        self.rank, self.world, self.cfg, self.name = rank, world, cfg, name
        self.mesh = init_device_mesh("cpu", (world,))
        self.root = Path(cfg["root"])
        self.results: dict[str, Any] = {}
        self.even = cfg["rep"] % 2 == 0

    def run(self, name: str, fn: Callable[[], Any]) -> dict[str, float]:
        profile = self.cfg.get("profile")
        out = measure(fn, Path(profile) / f"{name.replace('/', '_')}.pstats" if profile else None)
        self.results[name] = out
        return out

    def order(self, libs: tuple[str, ...]) -> tuple[str, ...]:
        return libs if self.even else libs[::-1]

    def remove(self, *paths: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    def finish(self) -> None:
        dist.barrier()
        if self.rank == 0:
            Path(self.cfg["result"]).write_text(json.dumps(self.results))

    def warm_up(self, local: bool, s3: bool, asynchronous: bool) -> None:
        """Every library and path once on a tiny state (untimed): imports, pools, first collectives."""
        state, _ = build_specs_state([(("w",), (64, 8))], self.mesh, fill=True)
        where = self.root / f"warmup-{self.name}"
        if local:
            for lib in LIBS:
                saver(lib, state, str(where / lib), None)()
                loader(lib, state, str(where / lib), None)()
        for store in self.cfg["stores"] if s3 else []:
            for lib in s3_libs(self.cfg, store):
                s3_saver(lib, state, f"{store['url']}/warmup-{self.name}/{lib}", store)()
                s3_loader(lib, state, f"{store['url']}/warmup-{self.name}/{lib}", store)()
        if asynchronous:
            for lib in ASYNC_LIBS:
                holder: list[Future[Any]] = []
                async_saver(lib, state, str(where / f"async-{lib}"), holder)()
                holder[0].result()
        if local and self.cfg.get("tensorstore", True):
            raw_writer(state, where / "raw")()
            raw_parallel_writer(state, where / "raw8")()
            layout = zarrckpt.open(str(where / "zarrckpt")).tensors()
            tensorstore_writer(state, file_kvstore(str(where / "ts")), layout)()
            tensorstore_reader(state, file_kvstore(str(where / "ts")))()
        self.remove(where)
        if s3 and self.rank == 0:
            from zarrckpt.testing import remove_tree

            for store in self.cfg["stores"]:
                remove_tree(f"{store['url']}/warmup-{self.name}", store["opts"])


def save_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Scenarios 1 (local save), 5 (async save), 3 (S3 save on each of ``cfg["stores"]``), with peak
    RSS (6) for each."""
    ph = Phase(rank, world, cfg, "save")
    parts = set(cfg["parts"])
    ph.warm_up("local" in parts, "s3" in parts, "async" in parts)
    if parts & {"local", "async"}:
        source, _ = build_state(cfg["gib"], ph.mesh, fill=True)
        if "local" in parts:
            savers = [s for s in SAVERS if s != "tensorstore" or cfg.get("tensorstore", True)]
            start = cfg["rep"] % len(SAVERS)
            order = [s for s in SAVERS[start:] + SAVERS[:start] if s in savers]
            layout = cfg.get("layout")
            if layout is None and "tensorstore" in order and order.index("zarrckpt") > order.index("tensorstore"):
                order.remove("tensorstore")  # TensorStore copies the layout of zarrckpt's checkpoint
                order.insert(order.index("zarrckpt") + 1, "tensorstore")
            for lib in order:
                path = ph.root / lib
                if lib == "raw":
                    fn = raw_writer(source, path)
                elif lib == "raw8":
                    fn = raw_parallel_writer(source, path)
                elif lib == "tensorstore":
                    layout = layout or zarrckpt.open(str(ph.root / "zarrckpt")).tensors()
                    fn = tensorstore_writer(source, file_kvstore(str(path)), layout)
                else:
                    fn = saver(lib, source, str(path), None)
                if rank == 0:
                    os.sync()  # untimed: whatever the previous writer left in flight is on disk
                ph.run(f"save/{lib}", fn)
            if rank == 0:
                ph.results["order"] = order
                ph.results["files"] = {lib: disk_usage(ph.root / lib) for lib in savers}
                ph.results["layout"] = zarrckpt.open(str(ph.root / "zarrckpt")).tensors()
            ph.remove(ph.root / "raw", ph.root / "raw8")  # TensorStore's arrays stay for the resharding load
        if "async" in parts:
            for call in ("first", "repeat"):
                for lib in ph.order(ASYNC_LIBS):
                    holder: list[Future[Any]] = []
                    path = ph.root / f"async-{lib}"
                    if call == "first" and lib != "dcp":
                        zarrckpt.release_staging()  # zarrckpt's first call at these shapes in this process
                    blocked = ph.run(f"async_{call}_call/{lib}", async_saver(lib, source, str(path), holder))
                    staged = getattr(holder[0], "wait_staged", lambda: None)
                    ready = ph.run(f"async_{call}_staged/{lib}", staged)
                    done = ph.run(f"async_{call}_wait/{lib}", holder[0].result)
                    ph.results[f"async_{call}/{lib}"] = {
                        "blocked": blocked["call_s"],
                        "staged": blocked["s"] + ready["s"],
                        "total": blocked["s"] + ready["s"] + done["s"],
                    }
                    ph.remove(path)
            if "local" not in parts:  # the synchronous reference, same state
                ph.run("save/zarrckpt", saver("zarrckpt", source, str(ph.root / "sync"), None))
                ph.remove(ph.root / "sync")
        del source
    if "s3" in parts:
        source, _ = build_state(cfg["s3_gib"], ph.mesh, fill=True)
        for store in cfg["stores"]:  # moto ("s3"), then the RADOS Gateway ("rgw") where there is one
            for lib in s3_libs(cfg, store):
                ph.run(f"{store['name']}_save/{lib}", s3_saver(lib, source, f"{store['url']}/{lib}", store))
        del source
    ph.finish()


def load_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Scenarios 2 and 3: load the checkpoints saved by ``save_phase`` on a different world size."""
    ph = Phase(rank, world, cfg, "load")
    parts = set(cfg["parts"])
    ph.warm_up("local" in parts, "s3" in parts, False)
    if "local" in parts:
        target, checksums = build_state(cfg["gib"], ph.mesh, fill=False)
        libs = RESHARD_LIBS if cfg.get("tensorstore", True) else LIBS
        if cfg.get("evict") and rank == 0:
            for lib in libs:
                evict_page_cache(ph.root / lib)
        for lib in ph.order(libs):
            path = ph.root / lib
            fn = tensorstore_reader(target, file_kvstore(str(path))) if lib == "tensorstore" else None
            ph.run(f"reshard/{lib}", fn or loader(lib, target, str(path), None))
            verify(target, checksums, f"{lib} resharding load")
        del target
    if "s3" in parts:
        target, checksums = build_state(cfg["s3_gib"], ph.mesh, fill=False)
        for store in cfg["stores"]:
            for lib in s3_libs(cfg, store):
                ph.run(f"{store['name']}_reshard/{lib}", s3_loader(lib, target, f"{store['url']}/{lib}", store))
                verify(target, checksums, f"{lib} resharding load from {store['name']}")
        del target
    ph.finish()


def lazy_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Scenario 4, the save side: ``world`` ranks save the expert tensors with both libraries."""
    ph = Phase(rank, world, cfg, "lazy")
    state, _ = build_specs_state(lazy_specs(tuple(cfg["lazy_shape"])), ph.mesh, fill=True)
    for lib in LIBS:
        ph.run(f"lazy_save/{lib}", saver(lib, state, f"{cfg['url']}/{lib}", cfg["opts"]))
    ph.finish()


__all__ = ["lazy_phase", "lazy_specs", "load_phase", "save_phase"]
