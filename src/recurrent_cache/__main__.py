"""``python -m recurrent_cache {demo,generate,inspect,convert} ...``: see ``recurrent_cache.cli``."""

import sys

from .cli import main

sys.exit(main())
