"""``python -m sglang_integration.daemon``: the daemon launcher (``launcher.main``)."""

from sglang_integration.daemon.launcher import main

main()
