"""``python -m layout_ledger.cli``: the same as the ``layout-ledger`` console script."""

import sys

from layout_ledger.cli import main

sys.exit(main())
