"""Where a weight cache daemon keeps its expert layout ledger: one file per daemon, i.e. per GPU.

The path comes from a template keyed by the device UUID, as sglang's own daemon files are
(``sglang.srt.weight_cache.protocol.get_socket_path`` fills
``SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE`` and refuses a template without ``{device_uuid}``): the
``--expert-layout-ledger`` setting (``settings.LEDGER_TEMPLATE``), else the default location
(``layout_ledger.store.locations``: /var/lib for root, else the XDG state home), whose private
directory the daemon makes ready before it opens the file.
"""

from __future__ import annotations

from pathlib import Path

from layout_ledger.store import locations
from sglang_integration.settings import LEDGER_TEMPLATE, check_ledger_template


def ledger_template() -> str:
    """The template in force: the setting (the launcher's flag or its env var), or the default
    location of this process's user."""
    configured = LEDGER_TEMPLATE.configured()
    if configured is not None:
        return configured
    return locations.default_ledger_template()


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
