"""The documentation's runnable examples: a page's python block whose first line is ``# zarrckpt:
NAME`` (tests/test_docs.py checks that the test its ``MARKED`` names runs each one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
_LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # a launcher's, not the example's


def example(page: str, name: str) -> str:
    """The code of the block marked ``name`` on ``docs/<page>`` (exactly one)."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (DOCS / page).read_text(), re.S | re.M)
    (code,) = [b for b in blocks if b.startswith(f"# zarrckpt: {name}\n")]
    return code


def run_example(
    page: str,
    name: str,
    cwd: Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    ranks: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run that block as ``example.py`` in ``cwd`` (with ``env`` added to the environment), as a user
    would (``ranks``: under torchrun, on that many processes); fails the test unless it exits 0."""
    from zarrckpt.testing import free_port

    (cwd / "example.py").write_text(example(page, name))
    env = {**{k: v for k, v in os.environ.items() if k not in _LAUNCHED}, **(env or {})}
    launch = [sys.executable]
    if ranks is not None:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
    done = subprocess.run([*launch, "example.py"], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done
