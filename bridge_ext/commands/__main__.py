"""``python -m bridge_ext.commands ...`` is ``nemo ...`` (what NeMo-Run's launches start on every rank)."""

import sys

from bridge_ext.commands import main

sys.exit(main())
