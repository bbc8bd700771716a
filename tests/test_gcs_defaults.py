"""gs:// works out of the box: without ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` in the environment, gcsfs
would serve gs:// with its experimental class, which asks the bucket's type over gRPC first and, against
the emulator, waited 60 s on each call. zarrckpt takes gcsfs's core class itself (the environment left
as it was), so a process that never heard of the variable saves and loads at once. An option gcsfs does not
take (which it would ignore) is named before any request, with the option meant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zarrckpt
from zarrckpt.cli import commands as cli
from zarrckpt.storage import gcsoptions
from zarrckpt.testing import free_port, unique_url
from zarrckpt.testing.gcs import gcs_storage_options

CHILD = """
import os, sys, time, torch, zarrckpt
from zarrckpt.storage.store import Storage
assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ
url, endpoint = sys.argv[1], sys.argv[2]
opts = {"endpoint_url": endpoint, "token": "anon", "project": "test", "skip_instance_cache": True}
began = time.monotonic()
zarrckpt.save({"w": torch.arange(6.0)}, url, storage_options=opts)
got = {"w": torch.zeros(6)}
zarrckpt.load(got, url, storage_options=opts)
assert torch.equal(got["w"], torch.arange(6.0))
fs = Storage(url, opts).fs
assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ, "the environment was changed"
print(type(fs).__module__, type(fs).__name__, round(time.monotonic() - began, 1))
"""


def test_gs_without_the_experimental_switch_saves_and_loads_at_once(gcs_server: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    env["PYTHONPATH"] = str(Path(zarrckpt.__file__).parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, unique_url("gs"), gcs_server], capture_output=True, text=True, env=env, timeout=50
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    module, name, _ = proc.stdout.split()
    assert (module, name) == ("gcsfs.core", "GCSFileSystem")


def test_the_gcs_options_known_without_gcsfs_are_gcsfs_options() -> None:
    """The names :mod:`zarrckpt.storage.gcsoptions` passes without asking gcsfs, and those it suggests, are
    ones the installed gcsfs takes; the test's own options pass."""
    assert gcsoptions._accepted() >= gcsoptions.COMMON
    assert {m for m in gcsoptions.MEANT.values() if m.isidentifier()} <= gcsoptions.COMMON
    gcsoptions.check("gs://b/x", gcs_storage_options("http://127.0.0.1:1"))


@pytest.mark.parametrize(
    ("option", "meant"),
    [
        ("endpoint", "endpoint_url"),
        ("credentials", "token (a service account's JSON key file"),
        ("project_id", "project"),
        ("anon", "token='anon'"),
        ("tokn", "token"),
        ("requester_pay", "requester_pays"),
    ],
)
def test_an_option_gcsfs_would_ignore_is_named_with_the_one_meant(
    option: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gcsfs takes any keyword and drops those it does not know: ``endpoint=...`` sent every request to
    storage.googleapis.com, retried for minutes where that is not reachable (issue 41). Said at once,
    before any request (nothing listens at the endpoint), with the option meant: exit code 3 from the CLI,
    ZarrckptError from the API."""
    dead = f"http://127.0.0.1:{free_port()}"
    flags = [f"--storage-option={option}=x", f"--storage-option=endpoint_url={dead}", "--storage-option=token=anon"]
    rc = cli.main(["ls", "gs://bucket/run", *flags])
    out, err = capsys.readouterr()
    said = f"error: unknown GCS storage option {option!r} for 'gs://bucket/run'; did you mean {meant}"
    assert rc == 3 and out == "" and err.startswith(said), err
    with pytest.raises(zarrckpt.ZarrckptError, match=f"unknown GCS storage option {option!r}"):
        zarrckpt.latest_step("gs://bucket/run", storage_options={option: "x", "token": "anon"})
