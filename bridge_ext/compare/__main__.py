"""``python -m bridge_ext.compare --worker SPEC``: one run of ``nemo llm compare`` (``bridge_ext.compare.worker``)."""

import sys

from bridge_ext.compare.worker import main

sys.exit(main())
