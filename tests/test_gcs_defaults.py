"""gs:// works out of the box: without ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` in the environment, gcsfs
would serve gs:// with its experimental class, which asks the bucket's type over gRPC first and, against
the emulator, waited 60 s on each call. zarrckpt takes gcsfs's core class itself (the environment left
as it was), so a process that never heard of the variable saves and loads at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zarrckpt
from zarrckpt.testing import unique_url

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
