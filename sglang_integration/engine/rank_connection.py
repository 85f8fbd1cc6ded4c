"""This engine rank's one kept connection for its begin, commit and abort (docs/protocol.md).

One engine rank per process, so one process-wide ``client.LayoutConnection``: made on the first
use, closed when the engine's session ends (``startup.close_session``).
"""

from __future__ import annotations

from sglang_integration.engine import client


class _ThisRank:
    connection: client.LayoutConnection | None = None


def rank_connection(socket_path: str, engine_id: str) -> client.LayoutConnection:
    """This rank's ``client.LayoutConnection`` to its daemon, made on first use."""
    connection = _ThisRank.connection
    if connection is None or (connection.socket_path, connection.engine_id) != (
        socket_path,
        engine_id,
    ):
        if connection is not None:
            connection.close()
        connection = _ThisRank.connection = client.LayoutConnection(socket_path, engine_id)
    return connection


def close_rank_connection() -> None:
    """Close this rank's move connection (its daemon thread sees EOF)."""
    connection, _ThisRank.connection = _ThisRank.connection, None
    if connection is not None:
        connection.close()
