"""DCP adapters: ``torch.distributed.checkpoint`` storage over the zarrckpt engine (rule: imports the
engine and below, never the face above it).

``dcp.save(sd, storage_writer=ZarrWriter(url))`` and ``dcp.load(sd, storage_reader=ZarrReader(url))``
write and read exactly what ``zarrckpt.save`` / ``zarrckpt.load`` do.
"""

from __future__ import annotations

from zarrckpt.dcp.reader import ZarrReader, ZarrStorageInfo, dcp_to_torch_save
from zarrckpt.dcp.writer import ZarrWriter

__all__ = ["ZarrReader", "ZarrStorageInfo", "ZarrWriter", "dcp_to_torch_save"]
