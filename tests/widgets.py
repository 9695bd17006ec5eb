"""An ipywidgets tree by label, for the explorer tests: {description or class name: widget}."""

from __future__ import annotations


def by_label(box) -> dict:
    """Every widget under `box` (depth first), keyed by its `description`, else its class name (the last wins)."""
    found, stack = {}, [box]
    while stack:
        node = stack.pop()
        stack += list(getattr(node, "children", ()))
        found[getattr(node, "description", None) or type(node).__name__] = node
    return found
