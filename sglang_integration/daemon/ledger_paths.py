"""Where a weight cache daemon keeps its expert layout ledger: one file per daemon, i.e. per GPU.

The path comes from a template keyed by the device UUID, as sglang's own daemon files are
(``sglang.srt.weight_cache.protocol.get_socket_path`` fills
``SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE`` and refuses a template without ``{device_uuid}``): the
``--expert-layout-ledger`` setting (``settings.LEDGER_TEMPLATE``), else a private directory beside
the daemon's socket, which the daemon makes ready before it opens the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_integration.settings import (
    DEFAULT_LEDGER_BESIDE_SOCKET,
    LEDGER_TEMPLATE,
    check_ledger_template,
)


def socket_template() -> str:
    """sglang's daemon socket template, read the way sglang reads it (its env field)."""
    from sglang.srt.environ import envs

    return str(envs.SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE.get())


def default_ledger_template(socket_path_template: str) -> str:
    """The ledger template beside a socket template (its private subdirectory)."""
    return os.path.join(os.path.dirname(socket_path_template), DEFAULT_LEDGER_BESIDE_SOCKET)


def ledger_template() -> str:
    """The template in force: the setting (the launcher's flag or its env var), or beside the
    socket."""
    configured = LEDGER_TEMPLATE.configured()
    if configured is not None:
        return configured
    return default_ledger_template(socket_template())


def ledger_path(device_uuid: str, template: str | None = None) -> str:
    """The ledger file of the daemon on the GPU ``device_uuid``."""
    template = ledger_template() if template is None else template
    return check_ledger_template(template).format(device_uuid=device_uuid)


def prepare_ledger_path(device_uuid: str) -> str:
    """The daemon's ledger path; the default location's private directory is made ready."""
    path = ledger_path(device_uuid)
    if LEDGER_TEMPLATE.configured() is None:
        from layout_ledger.store.files import ensure_private_directory

        ensure_private_directory(Path(path).parent)
    return path
