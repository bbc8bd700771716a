"""The text of arrays' ``zarr.json`` documents, made from templates (no I/O).

A save's arrays mostly differ only in key and shapes (a model's thousands of small tensors): their
documents are alike but for the shape, the shard and inner-chunk shapes, the dimension names and
the key. Each distinct rest is encoded once, with marks where those go, and each array's document
is that template's text with the array's own values put in: the very text
``encoder.encode(meta.to_json())`` gives (``tests/test_arraydoc.py`` compares them), at a tenth of
its cost (a JSON encoding of a ``zarr.json`` took 9.5 us; 20,000 of them were most of a save's
documents and manifest).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from zarrckpt.format.jsondoc import frozen

if TYPE_CHECKING:
    from zarrckpt.format.array import ArrayMeta

_FIELDS = ("shape", "shard", "chunk", "names", "key")  # what differs between arrays of one template
_MARKS = tuple(f"\x00zarrckpt-{f}\x00" for f in _FIELDS)  # (escaped in the text: never an array's own)
_MAX_TEMPLATES = 4096


class ArrayDocs:
    """Array ``zarr.json`` texts as ``encoder`` encodes them (its separators, ``ensure_ascii``)."""

    def __init__(self, encoder: json.JSONEncoder) -> None:
        self.encoder = encoder
        self._sep = encoder.item_separator
        # how the encoder spells a string (the C function encoder.encode calls for one)
        self._quote = json.encoder.encode_basestring_ascii if encoder.ensure_ascii else json.encoder.encode_basestring
        # (the rest of a document) -> its text cut at the marks, and which field goes in each cut;
        # None: no template (the document is encoded whole)
        self._templates: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[int, ...]] | None] = {}

    def text(self, meta: ArrayMeta) -> str:
        """``encoder.encode(meta.to_json())``."""
        rest = (
            meta.dtype,
            len(meta.shape),
            meta.role,
            meta.kind,
            frozen(meta.topology),
            meta.python_type,
            meta.constant,
            meta.per_rank,
            meta.separator,
        )
        try:
            template = self._templates[rest]
        except KeyError:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            template = self._templates[rest] = self._template(meta)
        if template is None:
            return self.encoder.encode(meta.to_json())
        pieces, order = template
        values = self._values(meta)
        out = [pieces[0]]
        for i, piece in zip(order, pieces[1:], strict=True):
            out += (values[i], piece)
        return "".join(out)

    def _values(self, meta: ArrayMeta) -> tuple[str, str, str, str, str]:
        """The text of each of :data:`_FIELDS` for ``meta``."""
        sep, shape, shard, chunk = self._sep, meta.shape, meta.shard_shape, meta.chunk_shape
        path = meta.path
        name = self._quote(path[path.rfind("/") + 1 :])[:-1]  # '"NAME' (escaped per character)
        shape_text = "[" + sep.join(map(str, shape)) + "]"
        shard_text = shape_text if shard == shape else "[" + sep.join(map(str, shard)) + "]"
        chunk_text = shard_text if chunk == shard else "[" + sep.join(map(str, chunk)) + "]"
        names = sep.join([name + "_dim_" + str(i) + '"' for i in range(len(shape))])
        return shape_text, shard_text, chunk_text, "[" + names + "]", self._quote(meta.key)

    def _template(self, meta: ArrayMeta) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """The text of ``meta``'s document with marks in place of :data:`_FIELDS`, cut at them; None
        when the marks are not each found once, or the template does not give ``meta``'s own text."""
        doc = meta.to_json()
        shape, shard, chunk, names, key = _MARKS
        grid, (codec,) = doc["chunk_grid"], doc["codecs"]  # (shared, read-only: replaced, not changed)
        doc["shape"], doc["dimension_names"] = shape, names
        doc["chunk_grid"] = {**grid, "configuration": {**grid["configuration"], "chunk_shape": shard}}
        doc["codecs"] = [{**codec, "configuration": {**codec["configuration"], "chunk_shape": chunk}}]
        doc["attributes"] = {**doc["attributes"], "zarrckpt": {**doc["attributes"]["zarrckpt"], "key": key}}
        text = self.encoder.encode(doc)
        cuts = []
        for i, mark in enumerate(_MARKS):
            spelled = self.encoder.encode(mark)
            at = text.find(spelled)
            if at < 0 or text.find(spelled, at + 1) >= 0:
                return None
            cuts.append((at, at + len(spelled), i))
        cuts.sort()
        pieces, order, last = [], [], 0
        for start, end, i in cuts:
            pieces.append(text[last:start])
            order.append(i)
            last = end
        pieces.append(text[last:])
        template = tuple(pieces), tuple(order)
        values = self._values(meta)
        made = pieces[0] + "".join(values[i] + p for i, p in zip(order, pieces[1:], strict=True))
        return template if made == self.encoder.encode(meta.to_json()) else None


SPACED = ArrayDocs(json.JSONEncoder(allow_nan=False))
"""The arrays' own ``zarr.json`` files (``json.dumps``' spacing)."""
COMPACT = ArrayDocs(json.JSONEncoder(allow_nan=False, separators=(",", ":")))
"""The arrays' documents inside the manifest's consolidated metadata."""
