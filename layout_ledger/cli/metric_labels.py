"""The names the Prometheus series of ``layout-ledger metrics`` use, and the ``--label`` rule.

Cheap on purpose (the parser checks ``--label`` with it before any verb is imported).
"""

from __future__ import annotations

import re

PREFIX = "sglang_expert_layout"
# Every per-ledger series carries these (``ledger``: the file's real path).
LEDGER_LABELS = ("ledger", "host", "device_uuid", "gpu_id", "tp_rank")
# Labels some series add of their own.
SERIES_LABELS = ("kind", "reason", "role")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def label_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a ``--label`` (None: it can)."""
    if not _LABEL_NAME.match(name) or name.startswith("__"):
        return (
            f"{name!r} is not a Prometheus label name (letters, digits and _, not starting with a "
            f"digit or __)"
        )
    if name in (*LEDGER_LABELS, *SERIES_LABELS):
        return f"{name!r} is a label the series already have"
    return None
