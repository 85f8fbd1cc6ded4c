"""One module per ``layout-ledger`` verb: its typed collect function (the library function; a
frozen dataclass read in one read transaction, so one consistent snapshot while the daemon
writes), its render function (human lines), and ``run(args)``, the thin wrapper that collects,
prints (``cli.output``) and returns the exit code. ``cli.app`` imports only the verb it runs.
"""
