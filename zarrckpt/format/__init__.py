"""The on-storage format, pure (rule: imports nothing of zarrckpt's but ``errors`` and ``types``; no I/O).

Boxes and grids (``layout``), keys, dtypes (the torch side of ``zarrckpt_dtypes``; ``zarrhook``
registers them with zarr-python), typed JSON values, constant fills, untrusted JSON reading
(``jsondoc``), an array's ``zarr.json`` (``array``), the shard object (``shard``), the commit
record (``integrity``) and the manifest (``manifest``): docs/FORMAT.md in code.
"""
