"""Recipes that cannot silently lose state, with real FSDP2 (``fully_shard``) and TP
(``parallelize_module``) models and AdamW, through ``get_state_dict`` / ``set_state_dict`` on gloo ranks:

- the FSDP2 recipe of docs/usage.md, run as it is written there: saved on 2 ranks, resumed on 4 and on 1;
- FSDP2 and dp x tp models with tied embeddings and a complex64 ``freqs_cis`` buffer: saved on 2 and
  4 ranks, loaded on 1, 2 and 4, 2-D into 1-D and back;
- docs/usage.md's table of what ``strict`` means, row by row, against ``dcp.load``.

Loaded states are compared bit for bit with full state dicts gathered when saving
(``StateDictOptions(full_state_dict=True)``) and stored with ``torch.save``, so the reference does not
go through zarrckpt. Each rank first checks that its target differs from the reference in every tensor.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import zarrckpt
from zarrckpt.testing import spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"
RECIPE = "# zarrckpt: fsdp2-recipe"
FULL = StateDictOptions(full_state_dict=True)


def doc_block(marker: str) -> str:
    """docs/usage.md's one ```python block whose first line is ``marker``."""
    blocks = re.findall(r"^```python\n(.*?)^```$", USAGE.read_text(), re.S | re.M)
    found = [b for b in blocks if b.startswith(marker + "\n")]
    assert len(found) == 1, f"docs/usage.md has {len(found)} python blocks starting with {marker!r}"
    return found[0]


# --------------------------------------------------------------------------- comparisons


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.contiguous().reshape(-1).view(torch.uint8)


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` is not ``want``: tensors by dtype, shape and bytes; containers by keys; the rest by ``==``."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list | tuple):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{where}: {got!r} vs {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{where}.{i}")]
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        return [] if same and torch.equal(_bits(got), _bits(want)) else [f"{where}: {got} vs {want}"]
    return [] if got == want else [f"{where}: {got!r} vs {want!r}"]


def equal_tensors(got: Any, want: Any, where: str = "") -> list[str]:
    """The tensors that ``got`` and ``want`` both hold at one place, bit-identical."""
    if isinstance(want, dict) and isinstance(got, dict):
        return [e for k in want.keys() & got.keys() for e in equal_tensors(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, torch.Tensor):
        return [] if differences(got, want) else [where]
    return []


def full_state(model: nn.Module, optim: torch.optim.Optimizer, rng: bool = False) -> dict[str, Any]:
    """Every tensor whole, on every rank (gathered by torch): weights and buffers, AdamW's state, param groups."""
    msd, osd = get_state_dict(model, optim, options=FULL)
    state = {"model": dict(msd), "optim": osd["state"], "param_groups": osd["param_groups"]}
    return state | ({"rng": torch.get_rng_state()} if rng else {})


def _check(rank: int, got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    diffs = differences(got, want)
    assert not diffs, f"rank {rank}, {what}: {len(diffs)} differences:\n" + "\n".join(diffs[:20])
    moments = {n for v in want["optim"].values() for n in v}
    assert moments == {"exp_avg", "exp_avg_sq", "step"}, moments


# --------------------------------------------------------------------------- the docs' FSDP2 recipe


def _recipe(code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_fsdp2_recipe"}
    exec(compile(code, f"{USAGE}:fsdp2-recipe", "exec"), namespace)
    return namespace


def _recipe_train_and_save(rank: int, world: int, code: str, url: str, ref: str) -> None:
    r = _recipe(code)
    model, optim = r["build"]()
    r["train"](model, optim, 3)
    r["save_checkpoint"](url, model, optim, 3)
    want = full_state(model, optim, rng=True)
    if rank == 0:
        torch.save(want, ref)


def _recipe_resume(rank: int, world: int, code: str, url: str, ref: str) -> None:
    r = _recipe(code)
    want = torch.load(ref, weights_only=True)
    same = equal_tensors(full_state(*r["build"](), rng=True), want)  # a throwaway: what a resume starts from
    assert not same, f"a fresh build already holds the saved {same}: the test would prove nothing"
    model, optim = r["build"]()
    step = r["load_checkpoint"](url, model, optim)
    assert step == 3
    _check(rank, full_state(model, optim, rng=True), want, f"resumed on {world} ranks")
    r["train"](model, optim, 1)  # training goes on from there
    assert {int(s["step"]) for s in full_state(model, optim)["optim"].values()} == {4}


@pytest.mark.slow
def test_fsdp2_recipe_saves_on_2_and_resumes_on_4_and_1(tmp_path: Path) -> None:
    code = doc_block(RECIPE)
    assert "get_state_dict(model, optim)" in code and "set_state_dict(model, optim" in code
    url, ref = str(tmp_path / "step3"), str(tmp_path / "saved.pt")
    spawn(2, _recipe_train_and_save, code, url, ref)
    for world in (4, 1):
        spawn(world, _recipe_resume, code, url, ref)


# --------------------------------------------------------------------------- FSDP2 and TP models

VOCAB, DIM, HIDDEN, HEAD_DIM, LAYERS, SEQ = 30, 16, 38, 4, 2, 8  # 30 and 38 rows: uneven shards


class Block(nn.Module):
    """Attention-like (rotary by ``freqs_cis``, heads split over TP ranks) plus an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, -1, HEAD_DIM // 2, 2)  # the heads this rank holds
        q = torch.view_as_real(torch.view_as_complex(q) * freqs_cis[:t, None, :]).reshape(b, t, -1)
        x = x + self.wo(q)
        return x + self.w2(F.gelu(self.w1(x)))


class Tiny(nn.Module):
    """Input embedding tied to the output head; ``freqs_cis`` a persistent complex64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        angles = torch.outer(torch.arange(SEQ).float(), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.layers:
            x = block(x, self.freqs_cis)
        return self.head(self.norm(x))


def build(layout: str, world: int, seed: int, steps: int) -> tuple[Tiny, torch.optim.Optimizer]:
    """``fsdp``: FSDP2 over all ranks; ``2d``: TP over ``tp`` then FSDP2 over ``dp``; ``plain``: one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Tiny()
    if layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"wq": ColwiseParallel(), "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}
        for block in model.layers:
            parallelize_module(block, mesh["tp"], plan)
        dp = mesh["dp"]
    else:
        assert layout in ("fsdp", "plain"), layout
        dp = init_device_mesh("cpu", (world,))
    if layout != "plain":
        for block in model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=data)
        F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        optim.step()
        optim.zero_grad()
    assert model.head.weight is model.tok.weight
    return model, optim


def _save(rank: int, world: int, layout: str, url: str) -> None:
    model, optim = build(layout, world, seed=0, steps=2)
    msd, osd = get_state_dict(model, optim)
    zarrckpt.save({"model": msd, "optim": osd}, url)
    want = full_state(model, optim)
    if rank == 0:
        torch.save(want, url + ".pt")
        ckpt = zarrckpt.open(url)
        assert ckpt["model.freqs_cis"].dtype == torch.complex64
        assert {"model.tok.weight", "model.head.weight", "optim.state.tok.weight.exp_avg"} <= set(ckpt.keys())


def _load(rank: int, world: int, layout: str, url: str) -> None:
    model, optim = build(layout, world, seed=1, steps=1)  # other weights, moments and step counts
    with torch.no_grad():
        model.freqs_cis.zero_()  # the buffer, too, must come from the checkpoint
    want = torch.load(url + ".pt", weights_only=True)
    same = equal_tensors(full_state(model, optim), want)
    assert not same, f"the target already holds the saved {same}: the test would prove nothing"
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    zarrckpt.load(state, url)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert model.head.weight is model.tok.weight, "the tie survives the load"
    _check(rank, full_state(model, optim), want, f"{Path(url).name} loaded as {layout} on {world} ranks")


def _scenarios(rank: int, world: int, root: str, steps: list[tuple[str, str, str]]) -> None:
    """``(save | load, layout, checkpoint name)``, in order, all in this one set of processes."""
    for what, layout, name in steps:
        (_save if what == "save" else _load)(rank, world, layout, f"{root}/{name}")
        dist.barrier()


@pytest.mark.slow
def test_fsdp2_and_tp_models_reshard(tmp_path: Path) -> None:
    """Saved by FSDP2 on 4 and 2 ranks and by dp2 x tp2; each loaded elsewhere, 2-D into 1-D and back."""
    root = str(tmp_path)
    spawn(
        4,
        _scenarios,
        root,
        [("save", "fsdp", "fsdp4"), ("save", "2d", "dp2tp2"), ("load", "fsdp", "dp2tp2"), ("load", "2d", "fsdp4")],
    )
    spawn(2, _scenarios, root, [("save", "fsdp", "fsdp2"), ("load", "fsdp", "fsdp4"), ("load", "fsdp", "dp2tp2")])
    spawn(
        1,
        _scenarios,
        root,
        [
            ("load", "fsdp", "fsdp2"),
            ("load", "fsdp", "dp2tp2"),
            ("load", "plain", "fsdp4"),
            ("load", "plain", "dp2tp2"),
        ],
    )


# --------------------------------------------------------------------------- what `strict` means


def _trained() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    return model, optim


def _zeroed(tree: Any) -> Any:
    """A copy with every tensor zero."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeroed(v) for k, v in tree.items()}
    return copy.deepcopy(tree)


def _model() -> dict[str, torch.Tensor]:
    return _zeroed(dict(_trained()[0].state_dict()))


def _optim() -> dict[str, Any]:
    return _zeroed(_trained()[1].state_dict())


LAYOUT = zarrckpt.LayoutMismatchError
# Each row of docs/usage.md's table: the target, then per loader what happens: a check of the loaded
# target, or (exception type, message pattern). ``dcp`` is dcp.load, ``strict`` and ``lenient``
# zarrckpt.load with strict=True and strict=False; ``log`` is what zarrckpt logs when it loads.
ROWS: dict[str, dict[str, Any]] = {
    "leaves out top-level subtrees": {
        "target": lambda: {"model": _model()},
        "dcp": "loads",
        "strict": "loads",
        "lenient": "loads",
        "log": r"not loading \d+ saved keys the target does not ask for \(under optim, trainer\)",
    },
    "leaves out keys inside a subtree": {
        "target": lambda: {"model": {"weight": torch.zeros(2, 3)}},
        "dcp": "loads",
        "strict": (LAYOUT, r"model\.bias: in the checkpoint, not expected"),
        "lenient": "loads",
        "log": r"strict=False; not in the checkpoint: \[\]; not loaded: \['model\.bias'\]",
    },
    "leaves out a top-level leaf": {
        "saved": "with a top-level step",
        "target": lambda: {"model": _model(), "optim": _optim()},
        "dcp": "loads",
        "strict": (LAYOUT, r"step: in the checkpoint, not expected"),
        "lenient": "loads",
        "log": r"strict=False; not in the checkpoint: \[\]; not loaded: \['step'\]",
    },
    "has a key the checkpoint lacks": {
        "target": lambda: {"model": {**_model(), "scale": torch.zeros(2)}, "optim": _optim()},
        "dcp": (BaseException, r"RuntimeError: Missing key in checkpoint state_dict: model\.scale"),
        "dcp_partial": "loads",
        "strict": (LAYOUT, r"model\.scale: expected, not in the checkpoint"),
        "lenient": "loads",
        "log": r"strict=False; not in the checkpoint: \['model\.scale'\]",
        "after": lambda t: torch.equal(t["model"]["scale"], torch.zeros(2)),  # left as it is
    },
    "holds a fresh optimizer's optim.state_dict()": {
        "target": lambda: {
            "model": _model(),
            "optim": torch.optim.AdamW(nn.Linear(3, 2).parameters(), lr=0.1).state_dict(),
        },
        "dcp": "loads",
        "strict": (LAYOUT, r"optim\.state: the target is an empty dict.*get_state_dict"),
        "lenient": (LAYOUT, r"optim\.state: the target is an empty dict.*get_state_dict"),
        "after": lambda t: t["optim"]["state"] == {},  # no moments loaded, and no error
    },
    "has a tensor of another shape": {
        "target": lambda: {"model": {"weight": torch.zeros(3, 3), "bias": torch.zeros(2)}},
        "dcp": (BaseException, r"ValueError: Size mismatch"),
        "strict": (LAYOUT, r"model\.weight"),
        "lenient": (LAYOUT, r"model\.weight"),
    },
    "has a tensor of another dtype": {
        "target": lambda: {"model": {"weight": torch.zeros(2, 3, dtype=torch.bfloat16), "bias": torch.zeros(2)}},
        "dcp": "loads",
        "strict": (LAYOUT, r"model\.weight"),
        "lenient": (LAYOUT, r"model\.weight"),
        "cast": "loads",
    },
}


@pytest.fixture(scope="module")
def saved_both_ways(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The same training state saved by DCP and by zarrckpt: step in a ``trainer`` subtree, or a top-level leaf."""
    root = tmp_path_factory.mktemp("strict")
    model, optim = _trained()
    base = {"model": model.state_dict(), "optim": optim.state_dict()}
    out = {}
    for name, state in {"": base | {"trainer": {"step": 3}}, "with a top-level step": base | {"step": 3}}.items():
        at = out[name] = {"dcp": str(root / f"dcp{len(out)}"), "zarr": str(root / f"zarr{len(out)}")}
        dcp.save(state, checkpoint_id=at["dcp"])
        zarrckpt.save(state, at["zarr"])
    return out


LOADERS: dict[str, Callable[[dict[str, Any], dict[str, str]], None]] = {
    "dcp": lambda t, at: dcp.load(t, checkpoint_id=at["dcp"]),
    "dcp_partial": lambda t, at: dcp.load(
        t, checkpoint_id=at["dcp"], planner=DefaultLoadPlanner(allow_partial_load=True)
    ),
    "strict": lambda t, at: zarrckpt.load(t, at["zarr"]),
    "lenient": lambda t, at: zarrckpt.load(t, at["zarr"], strict=False),
    "cast": lambda t, at: zarrckpt.load(t, at["zarr"], cast=True),
}


@pytest.mark.parametrize("row", ROWS)
def test_strict_table_next_to_dcp(
    row: str, saved_both_ways: dict[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    spec = ROWS[row]
    assert f"\n| {row}" in USAGE.read_text().replace("`", ""), f"docs/usage.md's table has no row {row!r}"
    saved_weight = _trained()[0].weight.detach()
    at = saved_both_ways[spec.get("saved", "")]
    for loader in [k for k in LOADERS if k in spec]:
        target, outcome = spec["target"](), spec[loader]
        caplog.clear()
        if outcome == "loads":
            with caplog.at_level(logging.INFO, logger="zarrckpt"):
                LOADERS[loader](target, at)
            weight = target["model"]["weight"]
            assert torch.equal(weight, saved_weight.to(weight.dtype)), f"{loader}: model.weight not loaded"
            assert spec.get("after", lambda t: True)(target), f"{loader}: {row}"
            if loader in ("strict", "lenient") and "log" in spec:
                said = [r.getMessage() for r in caplog.records]
                assert any(re.search(spec["log"], m) for m in said), (loader, said)
        else:
            kind, pattern = outcome
            with pytest.raises(kind, match=pattern):
                LOADERS[loader](target, at)
