"""Storage, the only I/O (rule: imports ``errors`` and ``types`` only; nothing else of zarrckpt's).

:class:`~zarrckpt.storage.store.Storage` is the one face (retries, create-only writes, bounded
concurrency) over two backends: local files (``local``) and fsspec / obstore filesystems
(``remote``); ``clients`` picks the client for a URL, ``s3config`` translates s3fs options for
obstore, ``caps`` says what each kind of storage does well, ``retry`` which failures are transient.
"""
