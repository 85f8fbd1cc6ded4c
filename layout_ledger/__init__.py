"""A persistent, crash-safe expert layout ledger for SGLang's weight cache daemon.

Import-light on purpose: ``layout-ledger`` (the CLI) and the daemon-side protocol logic must
never import sglang or torch, so this package imports nothing at module level beyond the
standard library. Import the submodules you need (``layout_ledger.store.ledger``,
``layout_ledger.wire.service``, ...).
"""

# The distribution's version (setup.cfg); `layout-ledger --version` prints the installed
# distribution's and falls back to this one when the package runs uninstalled.
__version__ = "0.1.0"
