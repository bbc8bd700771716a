"""The benchmark suite (benchmarks/run.py) must keep running: its cheapest scenario end to end,
and the report rendered from a full set of measurements (every scenario section)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zarrckpt.testing.rgw import rgw_available

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TITLES = [
    "## Targets",
    "## 1. Save, 4 ranks, local disk",
    "## 2. Resharding load 4 -> 3 ranks, local disk",
    "## 3. S3: save 4 ranks, resharding load 4 -> 3 ranks, on moto and on a Ceph RADOS Gateway",
    "## 4. Lazy read of one expert slice on S3",
    "## 5. Async save",
    "## 6. Peak RSS",
    "## 7. Many small tensors, local disk",
    "## GPU",
]


def _import_report():
    sys.path.insert(0, str(BENCH))
    try:
        import report
    finally:
        sys.path.remove(str(BENCH))
    return report


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_lazy_scenario_runs(tmp_path):
    """The lazy-read scenario (2 saving ranks, a small tensor, moto and, where Ceph is installed, a RADOS
    Gateway started by the suite) end to end; without Ceph the report says how to install it."""
    out = tmp_path / "latest.md"
    cmd = [sys.executable, str(BENCH / "run.py"), "--quick", "--only", "lazy", "--lazy-ranks", "2"]
    cmd += ["--lazy-shape", "8,64,64", "--lazy-index", "5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for title in TITLES:
        assert title in text, f"{title!r} missing from the report"
    assert text.count("_not run in this invocation") == 6  # sections 1, 2, 3, 5, 6, 7
    target = next(line for line in text.splitlines() if line.startswith("| lazy expert slice"))
    assert target.rstrip(" |").endswith(("PASS", "MISS")), target
    assert text.count("| zarrckpt | open + [i] |") == text.count("| dcp | dcp.load of the key |")
    why = rgw_available()
    if why is None:
        assert text.count("| zarrckpt | open + [i] |") == 2, "no lazy read measured on the RADOS Gateway"
        assert "**RGW**" in text
        gets = next(line for line in text.splitlines() if line.startswith("| lazy expert slice after open: GETs (RGW)"))
        assert gets.rstrip(" |").endswith(("PASS", "MISS")), gets
    else:
        assert text.count("| zarrckpt | open + [i] |") == 1
        assert "S3 on RGW NOT RUN" in text and ("apt-get install" in text or "--rgw off" in text), text[-2000:]
    assert (tmp_path / "targets.png").stat().st_size > 1000


def test_report_renders_every_section(tmp_path):
    """Every scenario section, the targets and the charts, from made-up measurements."""
    report = _import_report()
    ops = [
        "save",
        "reshard",
        "s3_save",
        "s3_reshard",
        "rgw_save",
        "rgw_reshard",
        "async_first_call",
        "async_repeat_call",
        *(f"many{w}_{op}" for w in (1, 4) for op in ("save", "load")),  # scenario 7
    ]
    libs = ["zarrckpt", "dcp", "tensorstore", "raw", "raw8", "s3tc"]
    meas = {"s": 1.0, "call_s": 0.1, "rss_peak": 2**30, "rss_extra": 2**20, "rchar": 1.05e9, "read_bytes": 0.0}
    run: dict = {f"{op}/{lib}": dict(meas) for op in ops for lib in libs}
    async_libs = [*libs, "zarrckpt-background"]  # async_save(..., staging="background")
    run |= {
        f"{op}/{lib}": {"blocked": 0.05, "staged": 0.3, "total": 1.2}
        for op in ("async_first", "async_repeat")
        for lib in async_libs
    }
    run |= {f"{op}/zarrckpt-background": dict(meas) for op in ("async_first_call", "async_repeat_call")}
    hits = {"requests": 10, "bytes_in": 10**9, "bytes_out": 10**9, "PUT": 9, "GET": 1}
    saves = ("s3_save", "s3_reshard", "rgw_save", "rgw_reshard")
    run |= {f"{op}/{lib}/s3": hits for op in saves for lib in ("zarrckpt", "dcp", "s3tc", "tensorstore")}
    run["files"] = {"zarrckpt": (334, 10**9, 10**9)}
    for w in (1, 4):
        run[f"many{w}_state"] = {"tensors": 20_001, "bytes": 7 * 10**8}
        run[f"many{w}_files"] = {"zarrckpt": (40_003, 7 * 10**8, 7 * 10**8), "dcp": (w + 1, 7 * 10**8, 7 * 10**8)}
    one = {"requests": 3, "bytes": 270_000, "kinds": {"GET": 3}, "s": 0.1, "round_trips": 1.1}
    lazy = {
        "key": "model.layers.0.moe.experts.w1",
        "shape": [64, 256, 256],
        "index": 5,
        "ranks": 8,
        "tensors": 3,
        "slice_bytes": 262_144,
        "layout": {"shard": [8, 256, 256], "chunk": [8, 256, 256]},
        "reps": 3,
        **{k: dict(one) for k in ("zarrckpt", "zarrckpt_open", "zarrckpt_index", "zarrckpt_later", "dcp")},
    }
    lazy["rgw"] = dict(lazy)
    info = {
        "about": ["made up"],
        "only": ["local", "s3", "lazy", "async", "many"],
        "state_bytes": 10**9,
        "s3_state_bytes": 10**9,
        "profile": None,
        "gpu": "no GPU",
        "many": {"tensors": 20_000, "big_mib": 64, "ranks": [1, 4]},
        "stores": {"s3": {"skip": {}}, "rgw": {"skip": {"tensorstore": "made-up reason"}}},
        "peers": {},
    }
    goals = report.targets([run], lazy, info)
    assert all(t.ok is not None for t in goals)
    text = report.render([run], lazy, info)
    for title in TITLES:
        assert title in text
    assert "_not run" not in text
    assert "### moto" in text and "### RGW" in text and "**RGW**" in text
    side = next(line for line in text.splitlines() if line.startswith("| operation | library | moto: median s"))
    assert "RGW: median s" in side and "RGW: requests" in side
    assert text.count("| PASS |") + text.count("| MISS |") == len(goals)
    for peer in ("| s3torchconnector |", "| TensorStore |", "| save: zarrckpt |", "| load: DCP |"):
        assert peer in text, peer
    assert "TensorStore zarr3: not run on RGW: made-up reason." in text
    assert any(t.name == "many tensors, 1 rank: save, zarrckpt time" for t in goals)


def test_clients_report_decides_by_the_measured_ratio():
    """benchmarks/clients.py says obstore should serve s3:// only if >= 1.3x faster on save and load
    with no more requests than s3fs; says which."""
    sys.path.insert(0, str(BENCH))
    try:
        import clients
    finally:
        sys.path.remove(str(BENCH))

    def runs(obstore_s: float, obstore_requests: int) -> list[dict]:
        hits = {"bytes_in": 10, "bytes_out": 10, "PUT": 1}
        row = {f"{op}/s3fs": {"s": 2.0, "requests": 100, **hits} for op in ("save", "load")}
        row |= {f"{op}/obstore": {"s": obstore_s, "requests": obstore_requests, **hits} for op in ("save", "load")}
        return [row]

    slower = clients.render(runs(1.8, 100), ["made up"], 10**6)
    assert "not >= 1.3x faster on both" in slower and "**s3fs should serve" in slower and "1.11x" in slower
    faster = clients.render(runs(1.0, 98), ["made up"], 10**6)
    assert "with no more requests" in faster and "**obstore serves s3:// by default**" in faster
    assert "2.00x" in faster
    more = clients.render(runs(1.0, 150), ["made up"], 10**6)
    assert "faster only with more requests" in more and "**s3fs should serve" in more


def test_s3_floor_report_says_whether_the_floor_allows_the_target():
    """benchmarks/s3_floor.py: the target row's verdict, and whether a bare client writing zarrckpt's
    objects is itself fast enough (the floor), from made-up times."""
    import argparse

    sys.path.insert(0, str(BENCH))
    try:
        import s3_floor
    finally:
        sys.path.remove(str(BENCH))

    def info(zarrckpt_s: float, bare_s: float) -> dict:
        times = {"zarrckpt": zarrckpt_s, "zarrckpt_no_md5": 1.0, "s3tc": 1.2, "bare_objects": bare_s, "bare_rank": 0.6}
        hits = {"requests": 3, "bytes": 0, "PUT": 3, "detail": []}
        run = {n: {"s": s, "s3": hits, "gateway_cpu_s": 0.5, "machine_busy": 0.9} for n, s in times.items()}
        cost = {"count": 4, "bytes": 2**20, "s": 0.1, "gateway_cpu_s": 0.2}
        return {
            "runs": [run | {"order": list(times)}],
            "objects": 3,
            "object_bytes": 100,
            "largest": 50,
            "costs": {"small": cost, "large": cost},
            "load": [(1.0, 1.0, 1.0)],
            "server": "made up",
            "wall_s": 1.0,
        }

    args = argparse.Namespace(gib=0.01, ranks=4, reps=1)
    passed = s3_floor.render(args, info(0.9, 0.8), [])
    assert "| save, zarrckpt speed / s3torchconnector (target >= 1.2x) | 1.33x | PASS |" in passed
    assert "| 1.50x | the floor allows the target |" in passed
    assert "| the save with its end-to-end MD5 check off, speed / s3torchconnector | 1.20x |" in passed
    missed = s3_floor.render(args, info(1.5, 1.1), [])
    assert "| 0.80x | MISS |" in missed and "| 1.09x | the target is above the floor |" in missed


@pytest.mark.timeout(120)
def test_per_tensor_benchmark_reports_the_floor_of_the_saves_own_files(tmp_path):
    """``per_tensor.py`` on a few tensors: every phase, then the bare rewrite of the save's own files,
    which counts exactly the files and directories a save of that state leaves."""
    cmd = [sys.executable, str(BENCH / "per_tensor.py"), "--tensors", "40", "--reps", "1", "--dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    for phase in ("collect", "planning", "shards", "documents", "commit", "other", "total", "fixed", "beyond"):
        assert phase in rows, done.stdout
    bare = next(line for line in done.stdout.splitlines() if line.startswith("bare files"))
    files, dirs = int(bare.split("save's ")[1].split()[0]), int(bare.split(" files and ")[1].split()[0])
    sys.path.insert(0, str(BENCH))
    try:
        import per_tensor
    finally:
        sys.path.remove(str(BENCH))
    import zarrckpt

    zarrckpt.save(per_tensor.build_state(40), str(tmp_path / "again"))
    made_dirs, made_files = per_tensor.saved_files(str(tmp_path / "again"))
    assert (files, dirs) == (len(made_files), len(made_dirs))
    assert files >= 2 * 41  # a shard and a zarr.json per tensor at least
    total, beyond, bare_s = float(rows["total"][1]), float(rows["beyond"][1]), float(bare.split()[2])
    assert beyond == pytest.approx(total - bare_s, abs=2e-3)
