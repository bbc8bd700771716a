"""Planning, pure (rule: imports ``format`` and ``storage.caps`` values, never I/O or process groups).

What a rank holds (``localstate``, ``rankdesc``, ``stateful``), the save plan (``save``) and its
coarser grid for small shards (``coarsen``), how a load's targets match the checkpoint (``load``),
which byte ranges to fetch (``fetch``, ``ranges``), and who reads what for whom (``fanout``,
``fanjoin``). Every planner returns frozen values.
"""
