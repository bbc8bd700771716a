"""Stateful values: objects with ``state_dict()`` and ``load_state_dict()`` (modules, optimizers,
data loaders, torchtitan's ``ModelWrapper`` / ``OptimizersContainer``, DCP's ``Stateful``) inside a
state dict, at any depth of its dicts.

Saving stores each one's ``state_dict()``. Loading builds the target from ``state_dict()``, loads
into it, then calls ``load_state_dict()`` with the result (after every tensor and value is in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, Mapping)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def resolve(state_dict: Mapping[str, Any]) -> tuple[MutableMapping[str, Any], Callable[[], None]]:
    """The state dict with every Stateful replaced by its ``state_dict()``, and what to run after a load.

    Dicts holding no Stateful are the caller's own (so a load replaces values in them); dicts on the
    way to one are copies, whose replaced plain entries the returned function writes back before it
    calls each ``load_state_dict()``.
    """
    copies: list[tuple[Mapping[str, Any], dict[str, Any], set[str]]] = []  # original, copy, keys not to write back
    loads: list[tuple[Any, dict[str, Any], str]] = []

    def holds(node: Mapping[str, Any]) -> bool:
        return any(is_stateful(v) or (isinstance(v, Mapping) and holds(v)) for v in node.values())

    def walk(node: Mapping[str, Any]) -> Mapping[str, Any]:
        if not holds(node):
            return node
        out: dict[str, Any] = {}
        own: set[str] = set()
        for key, value in node.items():
            if is_stateful(value):
                out[key] = value.state_dict()
                loads.append((value, out, key))
                own.add(key)
            elif isinstance(value, Mapping) and holds(value):
                out[key] = walk(value)
                own.add(key)
            else:
                out[key] = value
        copies.append((node, out, own))
        return out

    resolved = walk(state_dict)

    def after_load() -> None:
        for original, out, own in copies:
            if isinstance(original, MutableMapping):
                for key, value in out.items():
                    if key not in own and value is not original.get(key):
                        original[key] = value  # a value the load replaced in the copy
        for obj, out, key in loads:
            obj.load_state_dict(out[key])

    return resolved if isinstance(resolved, MutableMapping) else dict(resolved), after_load
