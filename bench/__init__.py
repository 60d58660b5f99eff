"""recurrent_cache's benchmark suite: ``python bench/run.py [--quick]`` or ``python -m bench``.

See bench/README.md for what each row measures.  Without an installed
package, the work tree's ``src/`` is used (the compiled core must be built).
"""

import sys
from pathlib import Path

try:
    import recurrent_cache  # noqa: F401
except ModuleNotFoundError as exc:  # neither installed nor on PYTHONPATH: use the work tree's src/
    if exc.name != "recurrent_cache":
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
