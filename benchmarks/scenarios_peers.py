"""The other libraries ``run.py`` measures zarrckpt against, as the rank processes run them, and the
many-tensors scenario (7).

- ``s3tc``: AWS's ``s3torchconnector`` (``s3torchconnector.dcp.S3StorageWriter`` / ``S3StorageReader``
  with ``dcp.save`` / ``dcp.load``): Mountpoint's S3 client (Rust, AWS CRT) under DCP's file layout;
- ``tensorstore``: TensorStore's zarr3 driver writing and reading the same arrays as zarrckpt's
  checkpoint (zarrckpt's shard / inner-chunk shapes and codecs), each rank its own region, on local
  disk (``file`` kvstore) and on S3 (its ``s3`` kvstore with an endpoint).

A store in ``cfg["stores"]`` names its endpoint, region and keys in ``opts`` (s3fs's storage_options);
``peer_endpoint`` is where s3torchconnector goes (on the RADOS Gateway: an ``etagproxy`` in front).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import build_specs_state, disk_usage, measure
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import zarrckpt

S3TC = "s3tc"


def peer_status() -> dict[str, str | None]:
    """Why each peer library cannot run here (None: it can); asked once by the driver."""
    out: dict[str, str | None] = {}
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        out[S3TC] = f"s3torchconnector not installed (`pip install 's3torchconnector[dcp]'`): {e}"
    else:
        out[S3TC] = None
    try:
        import tensorstore  # noqa: F401
    except ImportError as e:
        out["tensorstore"] = f"tensorstore not installed: {e}"
    else:
        out["tensorstore"] = None
    return out


# -- S3 connection details ---------------------------------------------------------------------


def s3_region(store: dict[str, Any]) -> str:
    region = store["opts"].get("client_kwargs", {}).get("region_name")
    return region or os.environ.get("AWS_DEFAULT_REGION", "us-east-1")


def use_keys(store: dict[str, Any]) -> None:
    """Both peers take their keys from the environment (AWS CRT's and TensorStore's default chain)."""
    os.environ["AWS_ACCESS_KEY_ID"] = store["opts"]["key"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = store["opts"]["secret"]


def _s3tc_fs(store: dict[str, Any], reader: Any = None) -> Any:
    """s3torchconnector's DCP filesystem on the store's endpoint. ``S3StorageWriter`` / ``Reader`` take
    no endpoint; their ``S3FileSystem`` takes an ``S3Client``, which does (path-style addressing)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    use_keys(store)
    region, config = s3_region(store), S3ClientConfig(force_path_style=True)
    client = S3Client(region, endpoint=store["peer_endpoint"], s3client_config=config)
    return S3FileSystem(region, s3_client=client, **({"reader_constructor": reader} if reader else {}))


def s3tc_saver(state: dict[str, Any], url: str, store: dict[str, Any]) -> Callable[[], None]:
    from s3torchconnector.dcp import S3StorageWriter

    def save() -> None:
        writer = S3StorageWriter(s3_region(store), url)
        writer.fs = _s3tc_fs(store)
        dcp.save(state, storage_writer=writer)

    return save


def s3tc_loader(state: dict[str, Any], url: str, store: dict[str, Any]) -> Callable[[], None]:
    from s3torchconnector.dcp import S3StorageReader

    def load() -> None:
        reader = S3StorageReader(s3_region(store), url)  # its default, DCP-optimized ranged reader
        reader.fs = _s3tc_fs(store, reader._reader_constructor)
        dcp.load(state, storage_reader=reader)

    return load


# -- TensorStore: the same arrays, each rank its own region ------------------------------------


def file_kvstore(root: str) -> Callable[[str], dict[str, Any]]:
    return lambda key: {"driver": "file", "path": f"{root}/{key.replace('.', '/')}/"}


def s3_kvstore(url: str, store: dict[str, Any]) -> Callable[[str], dict[str, Any]]:
    use_keys(store)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    base = {
        "driver": "s3",
        "bucket": bucket,
        "endpoint": store["opts"]["endpoint_url"],
        "aws_region": s3_region(store),
        "aws_credentials": {"type": "environment"},
    }
    return lambda key: base | {"path": f"{prefix}/{key.replace('.', '/')}/"}


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


def _offset(value: DTensor) -> int:
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return int(offset[0])


def _ts_spec(row: dict[str, Any], kvstore: dict[str, Any]) -> dict[str, Any]:
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    sharding = {"chunk_shape": row["chunk"], "codecs": inner, "index_codecs": inner, "index_location": "start"}
    meta = {
        "shape": row["shape"],
        "data_type": row["dtype"],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": row["shard"]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0,
        "codecs": [{"name": "sharding_indexed", "configuration": sharding}],
    }
    return {"driver": "zarr3", "kvstore": kvstore, "metadata": meta}


def tensorstore_writer(
    state: dict[str, Any], kvstore: Callable[[str], dict[str, Any]], layout: list[dict[str, Any]]
) -> Callable[[], None]:
    """TensorStore's zarr3 driver writes the same arrays with zarrckpt's shard / inner-chunk shapes
    and codecs (bytes + crc32c, index at the start): every rank writes its own region (one shard
    per tensor), and the array ``zarr.json`` documents are spread round-robin over the ranks.
    ``layout``: ``zarrckpt.open(url).tensors()`` of a zarrckpt checkpoint of the same state."""
    import tensorstore as ts

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = {row["key"]: row for row in layout}
    flat = _flat(state)

    def write() -> None:
        pending = []
        for i, (key, value) in enumerate(sorted(flat.items())):
            spec = _ts_spec(rows[key], kvstore(key))
            opened = ts.open(spec, create=True) if i % world == rank else None
            arr = ts.open(spec, assume_metadata=True).result()
            local = value.to_local()
            offset = _offset(value)
            pending.append(arr[offset : offset + local.shape[0]].write(local.numpy()))
            if opened is not None:
                pending.append(opened)
        for fut in pending:
            fut.result()
        dist.barrier()  # the save is done when every rank's part (and every zarr.json) is written

    return write


def tensorstore_reader(state: dict[str, Any], kvstore: Callable[[str], dict[str, Any]]) -> Callable[[], None]:
    """Every rank reads its own rows of each array (opened from its ``zarr.json``) into its target
    shard: TensorStore copies into a TensorStore view of the target's memory (no extra copy)."""
    import tensorstore as ts

    flat = _flat(state)

    def read() -> None:
        opened = [(ts.open({"driver": "zarr3", "kvstore": kvstore(key)}), value) for key, value in sorted(flat.items())]
        pending = []
        for fut, value in opened:
            local = value.to_local()
            offset = _offset(value)
            target = ts.array(local.numpy(), copy=False, write=True)
            pending.append(target.write(fut.result()[offset : offset + local.shape[0]]))
        for w in pending:
            w.result()

    return read


# -- scenario 7: many small tensors ------------------------------------------------------------

MANY_LIBS = ("zarrckpt", "dcp")


def many_sizes(n: int, seed: int = 27) -> list[int]:
    """Elements of each small tensor: 1-64 KiB of float32 each, from a seeded RNG (every rank the same)."""
    rng = random.Random(seed)
    return [rng.randint(256, 16384) for _ in range(n)]


def many_state(n: int, big_mib: float, mesh: Any) -> dict[str, Any]:
    """``n`` small plain tensors, the same on every rank (replicated, as norm weights and biases are in
    FSDP / DDP states), and one ``big_mib`` MiB float32 tensor, a ``Shard(0)`` DTensor over the ranks."""
    sizes = many_sizes(n)
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(27))
    small = {f"layers.{i // 16}.p{i % 16}": t.clone() for i, t in enumerate(flat.split(sizes))}
    del flat
    cols = 1024
    rows = max(1, round(big_mib * 2**20 / 4 / cols))
    big, _ = build_specs_state([(("big",), (rows, cols))], mesh, fill=True)
    return {"model": small, "big": big["big"]}


def _locals(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v.to_local() if isinstance(v, DTensor) else v for _, v in sorted(_flat(state).items())]


def many_raw_writer(state: dict[str, Any], root: Path) -> Callable[[], None]:
    """The raw limit: each rank writes its local shard of the big tensor and every world-th small tensor
    (each byte once over all ranks) to one file, sequentially, then fsyncs it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [t for i, t in enumerate(_locals(state["model"])) if i % world == rank] + [state["big"].to_local()]

    def write() -> None:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"rank{rank}.bin", "wb") as f:
            for t in mine:
                f.write(t.numpy().data.cast("B"))
            f.flush()
            os.fsync(f.fileno())

    return write


def many_raw_files_writer(state: dict[str, Any], root: Path) -> Callable[[], None]:
    """The per-object floor of one Zarr array per tensor: the same share of the bytes as
    :func:`many_raw_writer`, but each tensor in a directory of its own as two files (its data, and
    700 bytes standing for its ``zarr.json``), each fsync'd, 8 in flight (zarrckpt's local writes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [t for i, t in enumerate(_locals(state["model"])) if i % world == rank] + [state["big"].to_local()]
    doc = b" " * 700

    def one(item: tuple[int, torch.Tensor]) -> None:
        folder = root / f"{rank}-{item[0]}"
        folder.mkdir(parents=True)
        for name, data in (("c", item[1].numpy().data.cast("B")), ("zarr.json", doc)):
            with open(folder / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    def write() -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, enumerate(mine)))

    return write


def many_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Scenario 7 on ``world`` ranks: save the many-tensors state with each library (and the raw
    write), then load each checkpoint into a zeroed state of the same layout and check every tensor
    bit for bit. Results: ``many<world>_save/<lib>``, ``many<world>_load/<lib>``."""
    import json

    mesh = init_device_mesh("cpu", (world,))
    root = Path(cfg["root"]) / f"many{world}"
    results: dict[str, Any] = {}
    libs = MANY_LIBS if cfg["rep"] % 2 == 0 else MANY_LIBS[::-1]

    def save(lib: str, state: dict[str, Any], path: Path) -> Callable[[], None]:
        if lib == "zarrckpt":
            return lambda: zarrckpt.save(state, str(path))
        if lib == "raw":
            return many_raw_writer(state, path)
        if lib == "raw-files":
            return many_raw_files_writer(state, path)
        return lambda: dcp.save(state, storage_writer=FileSystemWriter(str(path)))

    def load(lib: str, state: dict[str, Any], path: Path) -> Callable[[], None]:
        if lib == "zarrckpt":
            return lambda: zarrckpt.load(state, str(path))
        return lambda: dcp.load(state, storage_reader=FileSystemReader(str(path)))

    tiny = many_state(32, 0.01, mesh)  # warm-up (untimed): imports, pools, first collectives
    for lib in MANY_LIBS:
        save(lib, tiny, root / f"warm-{lib}")()
        load(lib, tiny, root / f"warm-{lib}")()
    source = many_state(cfg["many_tensors"], cfg["many_big_mib"], mesh)

    def profile_to(name: str) -> Path | None:  # --profile: rank 0's threads, as the other scenarios
        return Path(cfg["profile"]) / f"{name.replace('/', '_')}.pstats" if cfg.get("profile") else None

    for lib in (*libs, "raw", "raw-files"):
        if rank == 0:
            os.sync()
        name = f"many{world}_save/{lib}"
        results[name] = measure(save(lib, source, root / lib), profile_to(name))
    expected = [crc32c.crc32c(t.numpy()) for t in _locals(source)]
    target = source
    del source
    for t in _locals(target):
        t.zero_()
    for lib in libs:
        name = f"many{world}_load/{lib}"
        results[name] = measure(load(lib, target, root / lib), profile_to(name))
        got = [crc32c.crc32c(t.numpy()) for t in _locals(target)]
        bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        if bad:
            raise AssertionError(f"rank {rank}: {lib} loaded wrong data into {len(bad)} tensors, e.g. {bad[:5]}")
        for t in _locals(target):
            t.zero_()
    dist.barrier()
    if rank == 0:
        results[f"many{world}_files"] = {lib: disk_usage(root / lib) for lib in (*MANY_LIBS, "raw", "raw-files")}
        small = sum(t.numel() * 4 for t in _locals(target["model"]))
        results[f"many{world}_state"] = {"tensors": len(expected), "bytes": small + target["big"].numel() * 4}
        Path(cfg["result"]).write_text(json.dumps(results))
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


__all__ = [
    "S3TC",
    "file_kvstore",
    "many_phase",
    "peer_status",
    "s3_kvstore",
    "s3tc_loader",
    "s3tc_saver",
    "tensorstore_reader",
    "tensorstore_writer",
]
