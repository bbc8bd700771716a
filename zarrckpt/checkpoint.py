"""Read-only, lazy access to a committed checkpoint: ``zarrckpt.open(url)``.

Opening reads the manifest only (one GET); indexing a tensor reads just the inner chunks the
index touches. No process group is needed. torch is imported only to hand tensors out (indexing,
``dtype``): listing and verifying a checkpoint never import it (``zarrckpt ls`` starts fast).
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from zarrckpt.display import Progress, VerifySummary, checkpoint_html
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import crctable
from zarrckpt.errors import InvalidCheckpointError, KeyNotFoundError, ModifiedCheckpointError, ZarrckptError
from zarrckpt.format import integrity, values
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.deferred import Deferred
from zarrckpt.format.keys import nest
from zarrckpt.format.manifest import Manifest
from zarrckpt.storage.store import Storage
from zarrckpt.tensorview import TensorView
from zarrckpt.types import URL

log = logging.getLogger("zarrckpt")


def open(
    url: URL, *, storage_options: dict[str, Any] | None = None, partial_reads: bool = True, allow_modified: bool = False
) -> Checkpoint:
    """Open the committed checkpoint at ``url`` for reading (no process group needed).

    Reads the manifest only (one GET); tensors are read when indexed (:class:`TensorView`).

    Args:
        url: the checkpoint: a local path or any fsspec URL (``s3://bucket/run/step_100``).
        storage_options: passed to fsspec for ``url`` (credentials, endpoint, ...).
        partial_reads: when an index needs only a small part of an inner chunk, fetch just those
            bytes. Such reads cannot check the chunk's crc32c (it covers the whole chunk); pass
            False to always read and verify whole inner chunks. :meth:`Checkpoint.verify` always
            reads everything.
        allow_modified: read a checkpoint another tool changed after it was committed, or one
            without a commit record (written before zarrckpt recorded one, or with the record
            removed), as it is now (any valid shard layout; each chunk's own crc32c still checked;
            an unrecorded checkpoint is logged as read unchecked). Without it, reading a tensor or
            the values that changed raises ``ModifiedCheckpointError``, and so does reading any
            tensor of an unrecorded checkpoint (its :attr:`~Checkpoint.metadata` is shown, with a
            logged warning that it is unchecked).

    Returns:
        The checkpoint, a read-only mapping of tensor key -> :class:`TensorView`.

    Raises:
        CheckpointNotFoundError: nothing at all is stored at ``url``.
        IncompleteCheckpointError: ``url`` holds a save that never committed (failed or still
            running), or a deletion in progress.
        InvalidCheckpointError: the manifest is malformed, of a newer format version, or not a
            zarrckpt checkpoint.
        StorageError: the storage refused or failed the request (bucket, permissions, network).
        ZarrckptError: ``url`` is empty, or fsspec cannot open storage for it.
    """
    storage = Storage(url, storage_options)
    manifest = protocol.read_manifest(storage)
    if manifest.unrecorded and not allow_modified:  # listing and showing it still work: say what they show
        log.warning(
            "%s; its values are shown unchecked, and reading its tensors needs allow_modified=True",
            manifest.unrecorded,
        )
    return Checkpoint(storage, manifest.as_is() if allow_modified else manifest, partial_reads, allow_modified)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint, opened read-only by :func:`open`: a mapping of tensor key -> :class:`TensorView`.

    ``len(ckpt)``, ``key in ckpt`` and ``for key in ckpt`` (sorted) go over the stored tensors and
    byte arrays; plain values (step, config) are in :attr:`metadata`. Nothing but the manifest is
    read until a tensor is indexed. Made by :func:`open`, not constructed directly.

    Attributes:
        storage: where the checkpoint is (``storage.url`` is its URL).
        manifest: the committed manifest: every array's metadata and the saved values.
        partial_reads: as passed to :func:`open`.
        allow_modified: as passed to :func:`open`.
    """

    storage: Storage
    manifest: Manifest
    partial_reads: bool = True
    allow_modified: bool = False
    # key -> its committed chunk checksums, fetched from the table with the array's first read
    _segments: dict[str, Deferred] = field(default_factory=dict, init=False, compare=False, repr=False)

    def keys(self) -> list[str]:
        """The keys of the stored arrays (tensors, byte strings, numpy arrays).

        Returns:
            The keys, sorted (flattened, dot-separated: ``"model.fc.weight"``).
        """
        return sorted(self.manifest.arrays)

    def __len__(self) -> int:
        return len(self.manifest.arrays)

    def __contains__(self, key: object) -> bool:
        return key in self.manifest.arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __getitem__(self, key: str) -> TensorView:
        """The stored tensor ``key``, not read yet: index the view to read it.

        Args:
            key: a tensor key, as :meth:`keys` lists it.

        Returns:
            A lazy view of the tensor.

        Raises:
            KeyNotFoundError: no tensor ``key``; the message suggests the closest keys. It is a
                ``KeyError`` too.
        """
        meta = self.manifest.arrays.get(key)
        if meta is None:
            close = difflib.get_close_matches(key, list(self.manifest.arrays), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyNotFoundError(f"no tensor {key!r} in {self.storage.url!r}{hint}")
        if meta.crc_segment is not None and not meta.committed_crc32c:
            found = self._segments.get(key)
            if found is None:
                found = self._segments.setdefault(key, crctable.segment_reader(self.storage, meta))
            meta = replace(meta, committed_crc32c=found)
        return TensorView(self, meta)

    def with_chunk_checksums(self) -> Checkpoint:
        """This checkpoint with every array's committed chunk checksums read at once (the whole chunk
        checksum table, one GET), for work that reads every tensor (verify, export) rather than one
        segment per tensor as its first read fetches it."""
        arrays = self.manifest.arrays.values()
        if not any(m.crc_segment is not None and not m.committed_crc32c for m in arrays):
            return self
        manifest = crctable.with_table(
            self.manifest,
            partial(crctable.read_table, self.storage),
            self.storage.retry.attempts,
            self.storage.where(integrity.TABLE),
        )
        return replace(self, manifest=manifest)

    @property
    def metadata(self) -> dict[str, Any]:
        """The non-tensor state (step, config, ...), nested as it was saved, each value of its saved
        type; a value saved pickled shows as a placeholder (``open()`` never unpickles).

        Of a checkpoint without a commit record they are shown unchecked (:func:`open` logs a
        warning): ``zarrckpt info`` shows them; ``zarrckpt.load`` refuses them without
        ``allow_modified=True``.

        Raises:
            ModifiedCheckpointError: the saved values were edited after commit (and the checkpoint
                was not opened with ``allow_modified=True``).
        """
        integrity.refuse_modified(integrity.recorded_changes(self.manifest.modified), [], self.storage.url)
        return nest({k: values.describe(v) for k, v in self.manifest.values.items()})

    @property
    def saved_world_size(self) -> int:
        """The number of ranks that saved the checkpoint (any number of ranks can load it)."""
        return self.manifest.world_size

    @property
    def topology(self) -> dict[str, Any]:
        """Deprecated: ``{"world_size": ckpt.saved_world_size}``, the only thing it ever held.

        Use :attr:`saved_world_size`; each tensor's own placements are in its ``zarr.json``. Emits a
        ``DeprecationWarning``.
        """
        warnings.warn(
            "Checkpoint.topology is deprecated: it holds only the world size; use Checkpoint.saved_world_size",
            DeprecationWarning,
            stacklevel=2,
        )
        return {"world_size": self.saved_world_size}

    def tensors(self) -> list[dict[str, Any]]:
        """A table of the stored arrays, sorted by key, as ``zarrckpt ls --json`` prints it.

        Returns:
            One dict per array: ``key``, ``role`` (a :class:`~zarrckpt.types.Role`), ``shape``,
            ``dtype`` (the Zarr data type name), ``bytes``, ``shard`` and ``chunk`` (the shard and
            inner-chunk shapes).
        """
        return [
            {
                "key": m.key,
                "role": m.role,
                "shape": list(m.shape),
                "dtype": m.dtype,
                "bytes": m.nbytes,
                "shard": list(m.shard_shape),
                "chunk": list(m.chunk_shape),
            }
            for m in sorted(self.manifest.arrays.values(), key=lambda m: m.key)
        ]

    def stats(self) -> dict[str, int]:
        """What this checkpoint has cost its store so far (opening it included: the manifest's GET).

        Returns:
            ``{"requests", "retries", "bytes_read", "bytes_written"}``: every attempt of a request
            counts (a retried one twice, and once in ``retries``), a listing once however many pages
            it took; bytes are those of object bodies.
        """
        return self.storage.traffic.snapshot()

    def verify(self, *, progress: bool = False) -> VerifySummary:
        """Check completeness and every checksum of every tensor (reads the whole checkpoint).

        Problems found (a missing or truncated shard, a chunk failing its checksum, an array's
        ``zarr.json`` changed after commit, no commit record to compare the checkpoint with, a
        storage failure while reading) are listed in the result, not raised. Opened with
        ``allow_modified=True``, the checkpoint is checked as it is now: every shard present and
        every chunk's own crc32c, nothing compared with a commit record.

        Args:
            progress: draw a progress bar on stderr meanwhile (redrawn in place on a terminal or in
                a notebook; elsewhere a plain line every 30 s and at the end).

        Returns:
            A summary dict: ``{"tensors", "bytes_read", "seconds", "problems": [...]}``; an empty
            ``problems`` list means every shard object is present and every chunk verifies. It
            prints as one line (``print(ckpt.verify())``) and shows as a table in notebooks.

        Raises:
            IncompleteCheckpointError: problems were found, and the checkpoint was overwritten or
                deleted while it was being verified (which explains them).
        """
        from zarrckpt.engine import verify  # reads data (numpy): not on the import path of `zarrckpt ls`

        start = time.perf_counter()
        manifest = self.with_chunk_checksums().manifest  # (one GET for every array's committed chunk checksums)
        problems = [
            f"{why}; its chunks were checked against their own crc32c only"
            if isinstance(why, integrity.Unrecorded)
            else f"modified after commit: {why}"
            for _, why in sorted(manifest.modified.items())
        ]
        arrays = sorted(manifest.arrays.values(), key=lambda m: m.key)
        bar = Progress("verify", len(arrays), sum(m.nbytes for m in arrays)) if progress else None
        try:  # what is stored, with sizes: one listing bounds the work by the objects that exist
            listing: dict[str, int] | None = self.storage.sizes()
        except ZarrckptError as e:
            problems.append(f"listing the checkpoint failed ({e}); each tensor's objects are listed on their own")
            listing = None
        lock, tally = threading.Lock(), [0, 0, 0]  # arrays checked, their bytes, bytes read

        def check(meta: ArrayMeta) -> str | None:  # the problem found
            read, problem = 0, None
            try:
                read += self._verify_array_doc(meta)
                read += verify.verify_array(self.storage, meta, any_layout=self.allow_modified, listing=listing)
            except ZarrckptError as e:
                problem = str(e)
            except MemoryError:  # a crafted size no check above caught: a problem to report, never a crash
                problem = f"{meta.key!r}: checking it needs more memory than this process can have"
            with lock:
                tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + meta.nbytes, tally[2] + read
                if bar is not None:
                    bar.update(*tally)
            return problem

        alone, together = verify.by_shards(arrays)  # (an array of many shards reads them side by side)
        found = dict(zip((m.key for m in together), self.storage.run_all(check, together), strict=True))
        found |= {meta.key: check(meta) for meta in alone}
        problems += [p for m in arrays if (p := found[m.key]) is not None]  # (in key order)
        fetched = tally[2]
        if bar is not None:
            bar.finish(fetched)
        if problems:
            protocol.check_unchanged(self.storage, self.manifest.save_id)  # a newer save explains them all
        return VerifySummary(
            tensors=len(arrays), bytes_read=fetched, seconds=time.perf_counter() - start, problems=problems
        )

    def _verify_array_doc(self, meta: ArrayMeta) -> int:
        """Check that the array's own ``zarr.json`` (what generic Zarr readers go by) says what the
        manifest says; returns the bytes read."""
        path = f"{meta.path}/zarr.json"
        try:
            raw = self.storage.read(path, 0)
        except FileNotFoundError:
            raise InvalidCheckpointError(
                f"{self.storage.where(path)} is missing: other Zarr readers cannot open {meta.key!r}"
            ) from None
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        own = ArrayMeta.from_json(meta.path, doc, self.storage.where(path))
        if own != meta:
            fields = (
                "shape",
                "dtype",
                "shard_shape",
                "chunk_shape",
                "role",
                "kind",
                "python_type",
                "constant",
                "per_rank",
            )
            differ = [f for f in fields if getattr(own, f) != getattr(meta, f)]
            changed = [f"{f} {_shown(meta, f)} -> {_shown(own, f)}" for f in differ]
            changes = ", ".join(changed)
            raise ModifiedCheckpointError(
                f"{self.storage.where(path)} was modified after commit by another writer ({changes}); the "
                "manifest, which zarrckpt reads by, still says what was committed",
                key=meta.key,
                chunk=path,
            )
        return len(raw)

    def _repr_html_(self) -> str:
        return checkpoint_html(self.storage.url, self.manifest, self.metadata)

    def __repr__(self) -> str:
        total = sum(m.nbytes for m in self.manifest.arrays.values())
        return f"<zarrckpt.Checkpoint {self.storage.url!r}: {len(self)} tensors, {total / 1e6:.1f} MB>"


def _shown(meta: ArrayMeta, field: str) -> Any:
    """A metadata field as a message shows it (a constant as its fill value; None: not constant)."""
    if field == "constant":
        return None if meta.constant is None else meta.fill_json()
    return getattr(meta, field)
