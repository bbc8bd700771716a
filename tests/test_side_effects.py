"""A checkpoint call never changes the run: save, async_save, load, open and the manager leave every
global random generator (Python's ``random``, numpy's, torch's) as they found it, on every backend,
with retries forced (a proxy answering 503 SlowDown to some requests, so both zarrckpt's retries and
the client's own retry with jitter). Before, gcsfs's retries drew their jitter from Python's global
generator, which the example's data loader also uses: the MoE demo on gs:// lost its loss check."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.testing import s3_storage_options, unique_url
from zarrckpt.testing.gcs import gcs_storage_options
from zarrckpt.testing.proxy import FaultProxy

G = torch.Generator().manual_seed(5)
STATE = {"model": {f"w{i}": torch.randn(64, 32, generator=G) for i in range(3)}, "step": 3}


def _rngs() -> tuple[Any, ...]:
    return random.getstate(), repr(np.random.get_state()), torch.get_rng_state()


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.fixture(params=["local", "memory", "s3-obstore", "s3-s3fs", "gcs"])
def where(
    request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, dict[str, Any], FaultProxy | None]]:
    kind, _, client = request.param.partition("-")
    if kind == "local":
        yield str(tmp_path / "run"), {}, None
        return
    if kind == "memory":
        yield f"memory://side-effects-{tmp_path.name}/run", {}, None
        return
    if client:
        monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    proxy = FaultProxy(request.getfixturevalue("s3_server" if kind == "s3" else "gcs_server"))
    options = (s3_storage_options if kind == "s3" else gcs_storage_options)(proxy.endpoint)
    yield unique_url("s3" if kind == "s3" else "gs"), options, proxy
    proxy.close()


def test_checkpoint_calls_leave_every_global_generator_alone(
    where: tuple[str, dict[str, Any], FaultProxy | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, opts, proxy = where
    monkeypatch.setenv("ZARRCKPT_RETRY_DELAY", "0.001")
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    before = _rngs()
    if proxy is not None:  # some writes and reads fail once: retried (by zarrckpt, and by the client)
        proxy.faults = [("PUT", "/c.0.0", 503)] * 3 + [("GET", "/c.0.0", 503)] * 3 + [("POST", "/o", 503)] * 3
    zarrckpt.save(STATE, f"{root}/a", storage_options=opts)
    got = {"model": {k: torch.zeros(64, 32) for k in STATE["model"]}, "step": 0}
    zarrckpt.load(got, f"{root}/a", storage_options=opts)
    zarrckpt.async_save(STATE, f"{root}/b", storage_options=opts).result(timeout=120)
    zarrckpt.open(f"{root}/b", storage_options=opts)["model.w0"][3]
    manager = zarrckpt.CheckpointManager(f"{root}/m", interval=1, keep_last=1, storage_options=opts)
    for step in (1, 2, 3):  # retention deletes in the background meanwhile
        manager.save(step, STATE)
    manager.load_latest(got)
    manager.close()
    zarrckpt.delete(f"{root}/a", storage_options=opts)
    assert _same(_rngs(), before), "a checkpoint call drew from a global random generator"
    assert all(torch.equal(got["model"][k], STATE["model"][k]) for k in STATE["model"])
    if proxy is not None:
        assert any(status == 503 for _, _, status in proxy.answered), "no request was retried"


def test_deletions_on_gcs_never_take_gcsfs_batch_delete(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs's batch delete retries the objects a batch answer refuses after a sleep drawn from
    Python's global random generator (a local ``import random`` in ``GCSFileSystem._rm_files``, out of
    reach of zarrckpt's isolation of the clients' randomness), so zarrckpt deletes on gs:// one object
    per request (retried by gcsfs's isolated retry and zarrckpt's own): overwrite, delete, gc."""
    from gcsfs.core import GCSFileSystem

    async def refuse(self: Any, paths: Any) -> Any:
        raise AssertionError("gcsfs's batch delete was called")

    monkeypatch.setattr(GCSFileSystem, "_rm_files", refuse)
    monkeypatch.setattr(GCSFileSystem, "on_google", True)  # gcsfs batches deletes only there, not on emulators
    opts, root = gcs_storage_options(gcs_server), unique_url("gs")
    zarrckpt.save(STATE, f"{root}/a", storage_options=opts)
    zarrckpt.save(STATE, f"{root}/a", storage_options=opts, overwrite=True)
    zarrckpt.delete(f"{root}/a", storage_options=opts)
    assert zarrckpt.list_checkpoints(root, storage_options=opts) == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpoint_calls_leave_the_garbage_collector_as_they_found_it(tmp_path: Any, enabled: bool) -> None:
    """Parsing and planning pause Python's cyclic collector; it comes back as it was, also after a failure."""
    was = gc.isenabled(), gc.get_threshold()
    (gc.enable if enabled else gc.disable)()
    try:
        zarrckpt.save(STATE, str(tmp_path / "a"))
        got = {"model": {k: torch.zeros(64, 32) for k in STATE["model"]}, "step": 0}
        zarrckpt.load(got, str(tmp_path / "a"))
        zarrckpt.open(str(tmp_path / "a"))["model.w0"][3]
        with pytest.raises(zarrckpt.LayoutMismatchError):
            zarrckpt.load({"model": {"w0": torch.zeros(3)}}, str(tmp_path / "a"))
        assert (gc.isenabled(), gc.get_threshold()) == (enabled, was[1])
    finally:
        (gc.enable if was[0] else gc.disable)()
