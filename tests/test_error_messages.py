"""Errors that point the right way: what a URL holds instead of a checkpoint, a truncated object with
its real length and the chunks it lost, and no server XML in any message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zarrckpt
from zarrckpt.cli import commands as cli
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog, s3_storage_options, unique_url
from zarrckpt.testing.gcs import gcs_storage_options
from zarrckpt.testing.rgw import rgw_storage_options

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
XML = re.compile(r"<\?xml|<Error>|</\w+>")


def test_a_dcp_checkpoint_is_named_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"looks like a DCP checkpoint.*zarrckpt import"):
        zarrckpt.open(tmp_path / "dcp")
    assert cli.main(["info", str(tmp_path / "dcp")]) == 3
    assert "looks like a DCP checkpoint" in capsys.readouterr().err


def test_a_root_of_checkpoints_and_an_ordinary_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (1, 2):
        zarrckpt.save({"w": torch.ones(3)}, tmp_path / "runs" / f"step_{step}")
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"a root of checkpoints \(step_1, step_2\).*zarrckpt ls"):
        zarrckpt.open(tmp_path / "runs")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"not a zarrckpt checkpoint .*todo\.txt"):
        zarrckpt.load({"w": torch.zeros(3)}, tmp_path / "notes")
    assert cli.main(["ls", str(tmp_path / "notes")]) == 3
    assert "not a zarrckpt checkpoint" in capsys.readouterr().err
    assert cli.main(["ls", str(tmp_path / "runs")]) == 0  # a root still lists its checkpoints
    assert "2 checkpoints under" in capsys.readouterr().out


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_truncated_object_read_lazily(
    client: str, s3_url: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range past the end: S3 answers 416 InvalidRange; the error gives the object's real length and
    how many chunks it lost, not the server's answer."""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    url, opts = s3_url
    zarrckpt.save({"w": torch.arange(1024 * 1024.0).reshape(1024, 1024)}, url, storage_options=opts, chunk_bytes=2**18)
    storage = Storage(url, opts)
    raw = storage.read("w/c.0.0")
    storage.write("w/c.0.0", [raw[: len(raw) // 3]])
    with pytest.raises(zarrckpt.CorruptChunkError) as err:
        zarrckpt.open(url, storage_options=opts)["w"][900, 5]
    message = str(err.value)
    assert f"is truncated: {len(raw) // 3} bytes of {len(raw)}, 11 of its 16 inner chunks" in message
    assert "416" not in message and not XML.search(message)


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_wrong_secret_is_said_in_words(client: str, rgw_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real S3 server refuses the signature; the message names the server's error code, no XML."""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    opts = {**rgw_storage_options(rgw_server), "secret": "not-the-secret"}
    with pytest.raises(zarrckpt.ZarrckptError) as err:
        zarrckpt.save({"w": torch.ones(3)}, unique_url("s3"), storage_options=opts)
    message = str(err.value)
    assert not XML.search(message), message
    assert "SignatureDoesNotMatch" in message or "403" in message or "Forbidden" in message, message


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_save_to_a_missing_bucket_fails_at_once(
    client: str, s3_server: str, s3_requests: RequestLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket that does not exist is named, after its first request: no retries, nothing written."""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    url = "s3://no-such-bucket/run/step_1"
    with pytest.raises(zarrckpt.StorageError) as err:
        zarrckpt.save({"w": torch.ones(3)}, url, storage_options=s3_storage_options(s3_server))
    assert str(err.value) == (
        f"listing {url}/ failed: the bucket 'no-such-bucket' does not exist: check its name and the endpoint "
        "(zarrckpt creates no buckets)"
    )
    asked = [(r.method, r.status) for r in s3_requests.requests("s3://no-such-bucket")]
    assert asked == [("GET", 404)], asked


def test_a_missing_gcs_bucket_is_named(gcs_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """gcsfs says only "not found" of an object in a bucket that does not exist: asked on the error's way,
    GCS says the bucket is missing, and the message names it. A listing there (ls, latest, a save's look)
    is no empty listing but a StorageError naming the bucket, as on S3 (it read as empty: no checkpoints)."""
    opts, url = gcs_storage_options(gcs_server), "gs://no-such-bucket/run/step_1"
    said = "the bucket 'no-such-bucket' does not exist: check its name and the endpoint (zarrckpt creates no buckets)"
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=re.escape(f"no checkpoint at '{url}': {said}")):
        zarrckpt.open(url, storage_options=opts)
    with pytest.raises(zarrckpt.StorageError) as err:
        zarrckpt.save({"w": torch.ones(3)}, url, storage_options=opts)
    assert str(err.value) == f"listing {url}/ failed: {said}"
    for listing in (zarrckpt.list_checkpoints, zarrckpt.latest_step, zarrckpt.committed_steps):
        with pytest.raises(zarrckpt.StorageError) as err:
            listing("gs://no-such-bucket/run", storage_options=opts)
        assert str(err.value) == f"listing gs://no-such-bucket/run/ failed: {said}", listing
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    capsys.readouterr()
    assert cli.main(["latest", "gs://no-such-bucket/run", *flags]) != 0
    assert said in capsys.readouterr().err
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="nothing is stored there"):  # a bucket that exists
        zarrckpt.open(unique_url("gs"), storage_options=opts)
