"""Adapters for the frameworks people train with (rule: the public face only, like the command line).

Each lives in a module of its own that imports its framework, so the core never needs it:
``zarrckpt.integrations.lightning``, ``.torchtitan``, ``.ray`` and ``.accelerate`` (``pip install
zarrckpt[lightning]``, ``[torchtitan]``, ``[ray]``, ``[accelerate]``).
"""
