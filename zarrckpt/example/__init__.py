"""A small Mixture-of-Experts transformer trained with PP x EP-MP x EP-DP on the CPU (gloo).

It exists to exercise zarrckpt the way large runs use it: dense parameters sharded over DP as
DTensor ``Shard(0)``, experts stacked ``[num_experts, ...]`` and split over EP-MP (and, inside
an EP-MP group, sharded or replicated over EP-DP), layers split over pipeline stages under
global keys, and the full training state (FP32 weights, Adam moments and step counters,
bookkeeping windows, step / token / epoch counters, data-loader position, RNG states, config,
data manifest) in every checkpoint.

- ``python -m zarrckpt.example.train`` — the training job (single process or under torchrun).
- ``zarrckpt.example.scenario`` — run A vs run B resumed under other topologies.
- ``python -m zarrckpt.demo`` (:mod:`zarrckpt.demo`, above the example) — the scenario on an embedded S3 server.
- ``zarrckpt.example.launch`` — a process group of one, or N local gloo processes (not the test harness).
"""
