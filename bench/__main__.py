"""``python -m bench [--quick] [--out-dir DIR]`` from the repository root: the same as bench/run.py."""

import sys

from bench.run import main

sys.exit(main())
