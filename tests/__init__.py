"""kiln's test suite.

ci/'s scripts import the modules beside them (registry_host, httpread, cpu_base, ...) as a script
run from ci/ finds them. Every test module, and every child process that imports one
(``python -c "from tests... import ..."``), comes through this package first, so ci/ goes on
the path here, once, rather than in conftest.py (which a child process never loads).
"""

import sys
from pathlib import Path

_CI = str(Path(__file__).resolve().parents[1] / "ci")
if _CI not in sys.path:
    sys.path.append(_CI)
