"""Every code block of README.md and docs/*.md runs in a test.

How each fenced block is exercised, by its language:

- ``python``: a block whose first line is ``# zarrckpt: NAME`` runs in the test ``MARKED[NAME]`` names
  (that test finds the block by its marker). Every other block runs here, in a fresh namespace, in a
  temporary working directory holding the checkpoints the examples name (``workdir``: ``ckpt/`` with
  tensors under ``model.layers.0.mlp.w1`` and ``model.layers.{0,1}.moe.experts.w1``, and more), after
  the prelude ``SNIPPETS`` gives it (the names a snippet takes as given), followed by that entry's check.
- ``bash``: every command line (``\\``-continuations joined, comments dropped) either runs here and must
  exit 0 (and pass its ``AFTER`` check, where it has one), with the substitutions below, or starts with a
  key of ``RUN_ELSEWHERE``, which names the test (or CI step) that already runs that command and says why
  it does not run here.
- ``json``: must parse (docs/FORMAT.md's elisions ``{…group…}`` stand for an object and read as ``{}``).
- ``text`` and unlabelled blocks are layouts and diagrams, not code; ``mermaid`` blocks are diagrams the
  site draws, of a kind mermaid knows (the lifecycle's state diagram names ``list_checkpoints``' states).

A block in any other language, a python block without a ``SNIPPETS`` entry or marker, or a command
line neither run nor mapped fails ``test_every_block_is_exercised``: a new block needs a test.

Substitutions in command lines, in order: ``SUBSTITUTIONS`` (checkpoint URLs on S3 become local
checkpoints this module saved; ``python -m zarrckpt ...``, "the same command", runs ``info``; the
example trainer runs a tenth of its steps), then the placeholders ``PLACEHOLDERS`` (``URL``, ``ROOT``,
...) as whole words; ``[optional arguments]`` are passed; ``zarrckpt`` and ``python`` are this
interpreter's.

And docs/reference.md documents every name of ``zarrckpt.__all__`` (mkdocstrings renders it; ``make docs``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, indented ones (inside list items) dedented."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```([\w-]*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, start = len(opening.group(1)), i
        i += 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            i += 1
        body = "".join(ln[indent:] + "\n" for ln in lines[start + 1 : i])
        found.append(Block(page, start + 1, opening.group(2), body))
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]

# --------------------------------------------------------------------------- python blocks

# marker -> the test that runs the block carrying it (and finds it by that marker)
MARKED = {
    "fsdp2-recipe": "tests/test_recipes.py::test_fsdp2_recipe_saves_on_2_and_resumes_on_4_and_1",
    "readme-example": "tests/test_docs.py::test_readme_example_runs_as_a_script",
    "lightning-example": "tests/test_lightning.py::test_the_documented_example_runs_as_a_script",
    "lightning-strategy": "tests/test_lightning.py::test_the_documented_strategy_example_on_2_ranks_then_1",
    "lightning-remote": "tests/test_lightning.py::test_zarr_model_checkpoint_needs_no_endpoint_in_the_environment",
    "ray-example": "tests/test_ray.py::test_the_documented_example_runs_as_a_script",
    "accelerate-example": "tests/test_accelerate.py::test_the_documented_example_runs_as_a_script",
    "torchtitan-example": "tests/test_torchtitan.py::test_the_documented_example_runs_as_a_script",
    "tier-example": "tests/test_tier.py::test_the_documented_example_runs_as_a_script",
}


def marker(block: Block) -> str | None:
    m = re.match(r"# zarrckpt: ([\w-]+)\n", block.code)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Snippet:
    prelude: str  # run first, in the same namespace: the names the snippet takes as given
    check: Callable[[dict[str, Any], Path], None]  # then this, on the namespace and the working directory


SAVED: dict[str, Any] = {}  # what ``workdir`` saved: flattened key -> tensor (filled by the fixture)

ASYNC_PRELUDE = """
import torch
import zarrckpt

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
batch = torch.randn(8, 4)
state = {"model": model.state_dict(), "step": 7}
url = "async-ckpt"
weight_before = model.weight.detach().clone()
"""


def _check_async(ns: dict[str, Any], wd: Path) -> None:
    ns["pending"].result(timeout=120)  # committed
    assert not torch.equal(ns["model"].weight, ns["weight_before"]), "optimizer.step() changed nothing"
    got = {"model": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, "step": 0}
    zarrckpt.load(got, wd / "async-ckpt")
    assert torch.equal(got["model"]["weight"], ns["weight_before"]) and got["step"] == 7  # the state before the step


def _check_zarr(ns: dict[str, Any], wd: Path) -> None:
    want = SAVED["model.layers.0.mlp.w1"][5].numpy()
    assert np.array_equal(ns["w"], want), (ns["w"], want)
    assert np.array_equal(ns["root"]["model/layers/0/mlp/w1"][5], want)


def _check_ray_storage(ns: dict[str, Any], wd: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow.fs")
    config = ns["run_config"]
    assert config.storage_path == "bucket/ray_results" and isinstance(config.storage_filesystem, pyarrow.PyFileSystem)
    assert config.storage_filesystem.handler.fs.storage_options["endpoint_url"] == "http://127.0.0.1:7480"


def _check_per_rank(ns: dict[str, Any], wd: Path) -> None:
    target, state = ns["target"], ns["state"]
    assert target["loader"] == zarrckpt.PerRank({"epoch": 3, "position": 1200}) and target["step"] == 100
    assert torch.equal(target["rng"]["torch"].value, state["rng"]["torch"].value)
    assert target["rng"]["python"] == state["rng"]["python"]
    assert zarrckpt.open(wd / "perrank-ckpt")["rng.torch"].shape == (1, state["rng"]["torch"].value.numel())


# a substring found in exactly one unmarked python block -> how that block runs
SNIPPETS = {
    'zarrckpt.load(target, "perrank-ckpt", per_rank="modulo")': Snippet("", _check_per_rank),
    'run_storage("s3://bucket/ray_results", storage_options=opts)': Snippet(
        "import pytest\nray = pytest.importorskip('ray')\nimport ray.train\n", _check_ray_storage
    ),
    'zarrckpt.async_save(state, url, staging="background")': Snippet(ASYNC_PRELUDE, _check_async),
    'zarr.open_group("ckpt", mode="r")': Snippet("", _check_zarr),
}


def snippet(block: Block) -> Snippet | None:
    found = [s for key, s in SNIPPETS.items() if key in block.code]
    return found[0] if len(found) == 1 else None


# --------------------------------------------------------------------------- command lines

# a command line's start -> the test (or CI step) that runs it, and why it does not run here
RUN_ELSEWHERE = {
    ".venv/bin/jupyter-execute notebooks/explore_checkpoint.ipynb": "tests/test_notebook.py::test_notebook_runs: "
    "the notebook runs top to bottom in a fresh kernel through nbclient, the library behind jupyter-execute",
    "make demo": "tests/test_example.py::test_resume_under_three_topologies_on_s3: the demo's scenario "
    "(zarrckpt.example.scenario.run, 8 ranks PP2 x EP2 x EP-DP2 -> 8 / 4 / 1 on moto) at test size; "
    "`make demo` itself starts 8 + 8 + 4 + 1 processes, about 60 s on 2 cores",
    "make test": ".ci/run: CI runs `make test` (ruff, mypy, lint-imports, the whole suite); the suite cannot run "
    "inside itself",
    "torchrun ": "tests/test_deploy.py::test_launch_train_checkpoint_to_s3_and_resume: deploy/torchrun.sh runs "
    "`torchrun ... -m zarrckpt.example.train` on 2 processes (PP2) to S3 and resumes it resharded on 1; "
    "8 processes do not fit a test on 2 cores (the 8-rank layout runs in tests/test_example.py)",
}

SUBSTITUTIONS = [  # (documented text, what runs here), in order
    ("s3://bucket/run/step-1000", "ckpt"),
    ("s3://bucket/run/imported", "imported"),
    ("s3://bucket/run1", "run1"),
    ("python -m zarrckpt ...", "python -m zarrckpt info URL"),
    ("--steps 200 --save-every 20", "--steps 20 --save-every 10"),  # ~27 s -> ~4 s on 2 cores
]
PLACEHOLDERS = {"URL_A": "ckpt", "URL_B": "ckpt-copy", "URL": "ckpt", "ROOT": "root", "OUT": "out", "COPY": "ckpt-cp"}


def command_lines(block: Block) -> list[str]:
    """A bash block's command lines as written: continuations joined, comment-only and blank lines dropped."""
    return [ln for ln in block.code.replace("\\\n", " ").splitlines() if shlex.split(ln, comments=True)]


COMMANDS = [(b, raw) for b in ALL if b.lang == "bash" for raw in command_lines(b)]


def normal(raw: str) -> str:
    """A command line's words, quotes and comment gone."""
    return " ".join(shlex.split(raw, comments=True))


def elsewhere(raw: str) -> str | None:
    return next((key for key in RUN_ELSEWHERE if normal(raw).startswith(key)), None)


def runs_here(raw: str) -> bool:
    words = normal(raw).split()
    return words[0] == "zarrckpt" or (words[:2] == ["python", "-m"] and words[2].split(".")[0] == "zarrckpt")


def to_run(raw: str) -> list[str]:
    """The argv that runs a documented command line here."""
    text = raw
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    text = re.sub(r"\b(" + "|".join(PLACEHOLDERS) + r")\b", lambda m: PLACEHOLDERS[m.group(1)], text)
    text = re.sub(r"(?<=\s)\[([^\[\]]*)\](?=\s|$)", r"\1", text)  # [optional arguments] are passed
    argv = shlex.split(text, comments=True)
    assert "://" not in " ".join(argv), f"a URL left unsubstituted: {argv}"
    program = {"python": sys.executable, "zarrckpt": str(BIN / "zarrckpt")}[argv[0]]
    return [program, *argv[1:]]


def _check_hf(wd: Path, out: str) -> None:
    from safetensors import safe_open

    with safe_open(wd / "hf" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert keys == {k.removeprefix("model.") for k in SAVED}, keys
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}


def _check_out(wd: Path, out: str) -> None:
    summary = json.loads(out)
    assert summary["files"] == ["model.safetensors"] and (wd / "out" / "model.safetensors").is_file(), summary


def _check_imported(wd: Path, out: str) -> None:
    assert sorted(zarrckpt.open(wd / "imported").keys()) == sorted(SAVED)


def _check_trained(wd: Path, out: str) -> None:
    assert zarrckpt.list_checkpoints(wd / "run1") == {f"step_{s:010d}": "committed" for s in (10, 20)}
    assert "done: step 20" in out


def _check_identical(wd: Path, out: str) -> None:
    assert "0 differ" in out, out


# a substring of a documented command line -> what must hold after it ran (beyond its exit status 0)
AFTER: dict[str, Callable[[Path, str], None]] = {
    "./hf --role main_weight --dtype bf16": _check_hf,
    "--include 'model.layers.*' --json": _check_out,
    "zarrckpt import ./dcp_ckpt": _check_imported,
    "python -m zarrckpt.example.train": _check_trained,
    "zarrckpt diff URL_A URL_B": _check_identical,
}

RUN = [(b, raw) for b, raw in COMMANDS if runs_here(raw) and not elsewhere(raw)]


# --------------------------------------------------------------------------- the working directory


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    layer0 = {
        "mlp": {"w1": torch.randn(8, 4, generator=g)},
        "moe": {"experts": {"w1": torch.randn(8, 4, 6, generator=g)}},
    }
    layer1 = {"moe": {"experts": {"w1": torch.randn(8, 4, 6, generator=g)}}}
    return {"model": {"layers": {"0": layer0, "1": layer1}}, "step": 1000}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the examples name: ``ckpt/`` and an identical ``ckpt-copy/``, a root of checkpoints ``root/``,
    and a DCP checkpoint ``dcp_ckpt/`` of the same state."""
    import warnings

    import torch.distributed.checkpoint as dcp

    wd = tmp_path_factory.mktemp("docs")
    state = _state()
    for url in ("ckpt", "ckpt-copy", "root/step_0000000010", "root/step_0000000020"):
        zarrckpt.save(state, wd / url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.distributed is not initialized: one process saves
        dcp.save(state, checkpoint_id=wd / "dcp_ckpt")
    layers = state["model"]["layers"]
    SAVED.clear()
    SAVED["model.layers.0.mlp.w1"] = layers["0"]["mlp"]["w1"]
    SAVED.update({f"model.layers.{i}.moe.experts.w1": layers[i]["moe"]["experts"]["w1"] for i in layers})
    assert sorted(zarrckpt.open(wd / "ckpt").keys()) == sorted(SAVED)
    return wd


# --------------------------------------------------------------------------- the tests


def _test_file_defines(target: str) -> bool:
    path, _, name = target.partition("::")
    return (ROOT / path).is_file() and re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M) is not None


def _mermaid_problems(block: Block) -> list[str]:
    """A diagram (drawn by the docs site): of a kind mermaid draws; the lifecycle's states are the ones
    ``list_checkpoints`` names."""
    from zarrckpt.engine.prefix import COMMITTED, DELETING_STATE, INCOMPLETE

    kind = block.code.split(None, 1)[0] if block.code.strip() else ""
    if kind not in ("flowchart", "stateDiagram-v2", "sequenceDiagram"):
        return [f"{block.where}: a mermaid block of kind {kind!r}"]
    if kind == "stateDiagram-v2":
        states = set(re.findall(r"^\s*(\w+) -->", block.code, re.M)) - {"[*]"}
        if states != {COMMITTED, DELETING_STATE, INCOMPLETE}:
            return [f"{block.where}: the states {sorted(states)} are not list_checkpoints' states"]
    return []


def test_the_index_links_every_page() -> None:
    """docs/index.md (the site's front page) lists every page of the site (issue 41: it had fallen behind)."""
    index = (ROOT / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages - linked == set(), f"docs/index.md links none of {sorted(pages - linked)}"


def test_every_block_is_exercised() -> None:
    problems = []
    for block in ALL:
        if block.lang == "python":
            name = marker(block)
            if name is None and snippet(block) is None:
                problems.append(f"{block.where}: a python block with neither a marker nor one SNIPPETS entry")
            elif name is not None and name not in MARKED:
                problems.append(f"{block.where}: marker {name!r} is not in MARKED")
        elif block.lang == "bash":
            for raw in command_lines(block):
                if not (elsewhere(raw) or runs_here(raw)):
                    problems.append(f"{block.where}: {raw!r} is neither run here nor in RUN_ELSEWHERE")
        elif block.lang == "mermaid":
            problems += _mermaid_problems(block)
        elif block.lang not in ("json", "text", ""):
            problems.append(f"{block.where}: a {block.lang!r} block: add a rule to tests/test_docs.py")
    assert problems == [], "\n".join(problems)


def test_the_maps_name_real_tests_and_real_blocks() -> None:
    python = [b for b in ALL if b.lang == "python"]
    for name, target in MARKED.items():
        assert sum(marker(b) == name for b in python) == 1, f"marker {name!r}: not exactly one block carries it"
        assert _test_file_defines(target), f"{target} does not exist"
        assert name in (ROOT / target.partition("::")[0]).read_text(), f"{target} does not look for {name!r}"
    for key in SNIPPETS:
        assert sum(key in b.code for b in python) == 1, f"SNIPPETS key {key!r} is not in exactly one python block"
    for key, why in RUN_ELSEWHERE.items():
        assert any(elsewhere(raw) == key for _, raw in COMMANDS), f"RUN_ELSEWHERE[{key!r}]: no such command in the docs"
        target = why.split(": ", 1)[0]
        if target == ".ci/run":
            assert key in (ROOT / ".ci" / "run").read_text().splitlines(), f"{key!r} is not in .ci/run"
        else:
            assert _test_file_defines(target), f"RUN_ELSEWHERE[{key!r}] names {target}, which does not exist"
    for key in AFTER:
        assert sum(key in raw for _, raw in RUN) == 1, f"AFTER key {key!r} is not in exactly one command run here"
    for old, _ in SUBSTITUTIONS:
        assert any(old in raw for _, raw in RUN), f"substitution {old!r} is used by no command run here"


def test_the_recipe_test_finds_its_block_by_marker() -> None:
    source = (ROOT / "tests" / "test_recipes.py").read_text()
    assert 'RECIPE = "# zarrckpt: fsdp2-recipe"' in source and '"docs" / "usage.md"' in source


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python" and marker(b) is None], ids=lambda b: b.where)
def test_python_block_runs(block: Block, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = snippet(block)
    assert spec is not None, f"{block.where}: no SNIPPETS entry"
    monkeypatch.chdir(workdir)
    ns: dict[str, Any] = {"__name__": "docs_snippet"}
    exec(compile(spec.prelude, f"{block.where} (prelude)", "exec"), ns)
    exec(compile(block.code, block.where, "exec"), ns)
    spec.check(ns, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("block, raw", RUN, ids=[f"{b.where}:{' '.join(raw.split()[:3])}" for b, raw in RUN])
def test_command_runs(block: Block, raw: str, workdir: Path) -> None:
    argv = to_run(raw)
    done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{block.where}: {shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    for key, check in AFTER.items():
        if key in raw:
            check(workdir, done.stdout)


@pytest.mark.slow
def test_readme_example_runs_as_a_script(tmp_path: Path) -> None:
    """The README's example as a script: it saves on 2 local gloo ranks, then loads and reads on 1; run
    again where it ran, it does the same (its save replaces the checkpoint the first run left)."""
    (code,) = [b.code for b in ALL if marker(b) == "readme-example"]
    (tmp_path / "readme_example.py").write_text(code)
    first = None
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, "readme_example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        assert done.stdout == "100 tensor([20., 21., 22., 23.])\n", done.stdout
        ckpt = zarrckpt.open(tmp_path / "ckpt")
        assert ckpt.saved_world_size == 2
        assert ckpt.manifest.save_id != first, "the second run saved again"
        first = ckpt.manifest.save_id


def test_json_blocks_parse() -> None:
    found = [b for b in ALL if b.lang == "json"]
    assert found, "no json blocks: docs/FORMAT.md shows the documents"
    for block in found:
        text = re.sub(r"\{…[^{}]*…\}", "{}", block.code)  # an elided object
        json.loads(text)


def _resolve(path: str) -> Any:
    """The object a ``::: dotted.path`` entry documents: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_the_reference_documents_every_public_name() -> None:
    """docs/reference.md has a ``:::`` entry for each name of ``zarrckpt.__all__``, or for the module it is in."""
    entries = re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "reference.md").read_text(), re.M)
    documented = []
    for entry in entries:
        obj = _resolve(entry)
        documented.append(obj)
        if inspect.ismodule(obj):  # a whole module: its public names
            documented += [getattr(obj, n) for n in getattr(obj, "__all__", dir(obj)) if not n.startswith("_")]
    public = [n for n in zarrckpt.__all__ if n != "__version__"]
    missing = [n for n in public if not any(getattr(zarrckpt, n) is d for d in documented)]
    assert len(entries) >= 20 and missing == [], f"not in docs/reference.md: {missing}"


def test_the_framework_store_table_names_real_tests() -> None:
    """docs/integrations.md's framework by store table (issue 41): each adapter's cell of each store says
    save, resume, retention and latest, and every test it names is defined in that adapter's test file,
    with the parameters named."""
    table = (ROOT / "docs" / "integrations.md").read_text().split("## What is tested, framework by store", 1)[1]
    rows = [line for line in table.split("\n## ", 1)[0].splitlines() if line.startswith("| ") and "✔" in line]
    files = ("lightning", "lightning", "torchtitan", "ray", "accelerate")  # the rows' order
    assert len(rows) == len(files), rows
    for row, file in zip(rows, files, strict=True):
        source = (ROOT / "tests" / f"test_{file}.py").read_text()
        for cell in row.strip("|").split(" | ")[1:]:
            assert all(word in cell for word in ("save", "resume", "retention", "latest", "✔")), cell
            named = re.findall(r"`(test_\w+)(?:\[([\w-]+)\])?`", cell)
            assert named, cell
            for name, params in named:
                assert re.search(rf"^def {name}\(", source, re.M), f"{name} is not in tests/test_{file}.py"
                for param in filter(None, params.split("-")):
                    assert f'"{param}"' in source, f"{name}[{params}]: no parameter {param!r}"
