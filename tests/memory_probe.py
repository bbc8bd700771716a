"""Measure extra host RSS during save / async_save / load of a 256 MiB state (run as a script).

``save_staged``: a sync save whose tensors are staged as GPU tensors are (pinned there, plain here),
within the budget (``zarrckpt.staging.write_local``'s ``moves``).

Prints one JSON line: {"mode": extra_peak_bytes, ...}. RSS is sampled every 2 ms by a thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from functools import partial

import torch

import zarrckpt
from zarrckpt import api, staging

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_during(fn) -> int:  # type: ignore[no-untyped-def]
    base, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return max(0, max(peak[0], rss()) - base)


def main() -> None:
    root, budget = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 4096) for i in range(16)}  # 16 x 16 MiB
    zarrckpt.save({"warm": torch.zeros(4)}, f"{root}/warm")  # imports, thread pools
    zarrckpt.load({"warm": torch.zeros(4)}, f"{root}/warm")

    def staged() -> None:
        api.write_local = partial(staging.write_local, moves=lambda t: True)  # type: ignore[assignment]
        try:
            zarrckpt.save(state, f"{root}/staged", staging_budget_bytes=budget)
        finally:
            api.write_local = staging.write_local  # type: ignore[assignment]
        zarrckpt.release_staging()

    out = {
        "save": peak_during(lambda: zarrckpt.save(state, f"{root}/sync")),
        "save_staged": peak_during(staged),
        "async_save": peak_during(
            lambda: zarrckpt.async_save(state, f"{root}/async", staging_budget_bytes=budget).result()
        ),
        "load": peak_during(lambda: zarrckpt.load(state, f"{root}/sync")),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
