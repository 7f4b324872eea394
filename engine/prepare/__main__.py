"""``python -m engine.prepare``: fetch, verify, convert and compress a model pair (see pipeline)."""

import sys

from engine.prepare.cli import main

sys.exit(main())
