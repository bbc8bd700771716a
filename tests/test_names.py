"""Object names checked against the storage's limits before a save writes anything.

Before, a 300-character key segment was refused by the filesystem only half-way (a StorageError and
an incomplete prefix that blocked the next save); an S3 key over 1,024 bytes likewise by the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.format.array import ArrayMeta
from zarrckpt.plan.names import check_names, longest_names
from zarrckpt.storage.caps import NameLimits
from zarrckpt.storage.store import Storage
from zarrckpt.testing import spawn

LONG = "x" * 300


def _one_rank_holds_a_long_name(rank: int, world: int, url: str, how: str) -> None:
    key = f"rank{rank}" + ("" if rank < 2 else LONG)
    state = {"model": {"w": torch.arange(3.0)}, "rng": {key: torch.arange(2.0) + rank}}  # (not constant: written)
    with pytest.raises(zarrckpt.InvalidKeyError, match="is 305 bytes"):  # rank 0 checks every name, each rank raises
        if how == "save":
            zarrckpt.save(state, url)
        else:
            zarrckpt.async_save(state, url).result()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_name_one_rank_holds_is_refused_on_every_rank(tmp_path: Path, how: str) -> None:
    """Rank 2's own key is too long: only rank 0 (which plans every array) and rank 2 hold it, and
    rank 1 raises the same error too instead of waiting for them in the next collective."""
    spawn(3, _one_rank_holds_a_long_name, str(tmp_path / "ck"), how)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("how", ["save", "async_save", "dcp"])
def test_a_segment_too_long_for_the_filesystem_is_refused_before_writing(tmp_path: Path, how: str) -> None:
    url = tmp_path / "ck"
    state = {"model": {LONG: torch.ones(3)}, "step": 1}
    with pytest.raises(zarrckpt.InvalidKeyError, match=r"segment 'x{40}\.\.\.' is 300 bytes, and local files allow"):
        if how == "save":
            zarrckpt.save(state, url)
        elif how == "async_save":
            zarrckpt.async_save(state, url).result()
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.api import CheckpointException

            from zarrckpt.errors import causes

            try:
                dcp.save(state, storage_writer=zarrckpt.ZarrWriter(url), no_dist=True)
            except CheckpointException as e:
                raise next(c for c in causes(e) if isinstance(c, zarrckpt.InvalidKeyError)) from None
    assert not url.exists(), "nothing was written: no incomplete prefix blocks the next save"
    zarrckpt.save({"model": {"short": torch.ones(3)}, "step": 1}, url)


def test_an_s3_key_over_1024_bytes_is_refused_before_any_request(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_url
    deep = {f"level{i}": {} for i in range(1)}
    node: dict[str, Any] = deep
    for i in range(40):  # 40 segments of 30 bytes: an object name of ~1,270 bytes
        node = node.setdefault(f"segment_{i:02d}_" + "y" * 19, {})
    node["w"] = torch.ones(2)
    with pytest.raises(zarrckpt.InvalidKeyError, match="S3 allow at most 1024"):
        zarrckpt.save(deep, url, storage_options=opts)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.open(url, storage_options=opts)


def test_the_limits_follow_the_storage(tmp_path: Path) -> None:
    local = Storage(tmp_path / "a" / "b").name_limits
    assert local.kind == "local files" and local.component_bytes == 255 and local.temp_suffix_bytes == 17
    assert Storage("memory://x/y").name_limits.name_bytes is None
    meta = ArrayMeta("a.b", (10, 20), "float32", (3, 20), (3, 20))
    assert longest_names(meta) == ["a/b/zarr.json", "a/b/c.3.0"]
    s3 = NameLimits("S3", 1011, None, 1024)  # a long prefix: 1,011 bytes of the key taken already
    with pytest.raises(zarrckpt.InvalidKeyError, match="named by 1025 bytes"):  # 1011 + "/" + "a/b/zarr.json"
        check_names([meta], s3, "s3://b/prefix")
    check_names([meta], NameLimits("S3", 1010, None, 1024), "s3://b/prefix")
