"""zarrckpt's fsspec-free local files (``zarrckpt.storage.localfs``) against fsspec's own
``LocalFileSystem`` as the oracle: the same URLs name the same paths, and every call Storage makes
answers the same (entries, sizes, kinds, links, missing paths, ranges)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from zarrckpt.storage.localfs import LocalFiles, local_path
from zarrckpt.storage.store import Storage

URLS = [
    "ckpt",
    "./ckpt",
    "ckpt/",
    ".",
    "a/b/../c",
    "/abs/ckpt",
    "/abs/ckpt//",
    "/",
    "~/ckpt",
    "file:///abs/ckpt",
    "file://rel/ckpt",
    "local:///abs/ckpt",
    "file:rel",
    "c:/x",  # a one-letter "protocol": fsspec reads it as a (Windows) path
    "weird:name",
]
NOT_LOCAL = ["s3://bucket/ckpt", "gs://b/c", "memory://x", "simplecache::s3://b/c", "data:,abc", "http://h/x"]


@pytest.mark.parametrize("url", URLS)
def test_local_urls_name_the_path_fsspec_names(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, root = fsspec.core.url_to_fs(url)
    assert isinstance(fs, LocalFileSystem)
    assert local_path(url) == root


@pytest.mark.parametrize("url", NOT_LOCAL)
def test_other_urls_are_not_local(url: str) -> None:
    assert local_path(url) is None


def _tree(root: Path) -> None:
    (root / "d" / "e").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "d" / "b.json").write_bytes(b"{}")
    (root / "d" / "e" / "c").write_bytes(b"x" * 100)
    (root / "link-file").symlink_to(root / "a.bin")
    (root / "link-dir").symlink_to(root / "d")
    (root / "dangling").symlink_to(root / "gone")


def _entries(found: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    return sorted((str(e["name"]), int(e["size"]), str(e["type"])) for e in found)


def test_every_call_storage_makes_answers_as_fsspec(tmp_path: Path) -> None:
    _tree(tmp_path)
    ours, theirs = LocalFiles(), LocalFileSystem()
    root = str(tmp_path)
    for path in (root, f"{root}/d", f"{root}/empty", f"{root}/a.bin", f"{root}/link-dir"):
        assert _entries(ours.ls(path)) == _entries(theirs.ls(path, detail=True)), path
    for path in (root, f"{root}/d", f"{root}/a.bin", f"{root}/missing", f"{root}/empty"):
        assert ours.find(path) == theirs.find(path, withdirs=False), path
        mine, fss = ours.find(path, detail=True), theirs.find(path, withdirs=False, detail=True)
        assert list(mine) == list(fss), path
        assert all(mine[n]["size"] == fss[n]["size"] for n in mine if fss[n]), path
    for path in (f"{root}/a.bin", f"{root}/d", f"{root}/link-file"):
        assert {k: ours.info(path)[k] for k in ("name", "size", "type")} == {
            k: theirs.info(path)[k] for k in ("name", "size", "type")
        }
        assert ours.modified(path) == theirs.modified(path)
    for path in (f"{root}/a.bin", f"{root}/missing", f"{root}/dangling", f"{root}/d"):
        assert ours.exists(path) == theirs.exists(path), path
    for start, end in [(None, None), (2, None), (2, 5), (-3, None), (-4, -1), (8, 20), (20, None), (None, 4)]:
        assert ours.cat_file(f"{root}/a.bin", start, end) == theirs.cat_file(f"{root}/a.bin", start, end)
    for call in (lambda fs: fs.ls(f"{root}/missing"), lambda fs: fs.cat_file(f"{root}/missing")):
        for fs in (ours, theirs):
            with pytest.raises(FileNotFoundError):
                call(fs)


def test_deleting_matches_fsspec(tmp_path: Path) -> None:
    for name, fs in (("ours", LocalFiles()), ("theirs", LocalFileSystem())):
        root = tmp_path / name
        root.mkdir()
        _tree(root)
        fs.rm([f"{root}/a.bin", f"{root}/link-dir"])  # a link to a directory: the link, not the directory
        fs.rm_file(f"{root}/d/b.json")
        assert sorted(os.listdir(root)) == ["d", "dangling", "empty", "link-file"]
        assert os.listdir(root / "d") == ["e"]
        fs.rm(str(root), recursive=True)
        assert not root.exists()
        with pytest.raises(FileNotFoundError):
            fs.rm_file(f"{root}/a.bin")


def test_a_local_storage_imports_no_fsspec(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ck"))
    assert isinstance(storage.fs, LocalFiles) and storage.client == "local"
    storage.write("x/y", [b"abc"])
    assert storage.entries() == {"x": None} and storage.sizes() == {"x/y": 3}
    assert Storage(f"file://{tmp_path}/ck").sizes() == {"x/y": 3}


def test_listing_a_directory_created_meanwhile_lists_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two saves racing to one new URL: one lists the root while the other creates it. A check
    "is it a directory?" made just before the directory appeared must not turn the listing into
    an entry of the root itself (the loser then refused the URL as 'not empty' instead of seeing
    the other save's marker). The listing decides in one call."""
    root = tmp_path / "ck"
    root.mkdir()
    monkeypatch.setattr(os.path, "isdir", lambda p: False)  # a check that ran before the mkdir
    assert LocalFiles().ls(str(root)) == []
    assert Storage(str(root)).names() == set()
    (root / "f").write_bytes(b"x")
    assert [e["name"] for e in LocalFiles().ls(str(root / "f"))] == [str(root / "f")]  # a file: itself
