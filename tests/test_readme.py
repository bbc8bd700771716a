"""README's "How it works" table names every module and subpackage of zarrckpt/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_module_table_matches_the_layout() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## How it works", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/.]+)`", "\n".join(ln for ln in table.splitlines() if ln.startswith("| `"))))
    package = ROOT / "zarrckpt"
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert modules - named == set(), "modules missing from README's table"
    files = {p.name for p in package.rglob("*.py")} | {p.relative_to(ROOT).as_posix() for p in package.rglob("*.py")}
    assert {n for n in named if n.endswith(".py")} - files == set(), "modules in README's table that are gone"
