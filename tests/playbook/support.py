"""A notebook run as `playbook.run` records it (`entry`), for the playbook tests."""

from __future__ import annotations


def entry(name: str, status: str = "ok", results: dict | None = None) -> dict:
    return dict(name=name, title=name, status=status, seconds=1.0, cells=2, html=f"notebook-{name}.html",
                error=None if status == "ok" else "CellExecutionError: boom", results=results or {})
