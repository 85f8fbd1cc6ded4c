"""SQL text shared by the ledger's readers: placeholders only, every value a bound parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def in_list(name: str, values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``(:name0, :name1, ...)`` for ``column IN ...`` over ``values``, and its parameters."""
    marks = ", ".join(f":{name}{n}" for n in range(len(values)))
    return f"({marks})", {f"{name}{n}": value for n, value in enumerate(values)}
