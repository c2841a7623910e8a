"""Suite-wide setup: the `stepscope` command of this interpreter's environment is the one tests start."""

import os
import sys

# Tests start real `stepscope` processes; run from `.venv/bin/pytest` without an activated venv, the
# console script would not be on PATH. Put this interpreter's bin directory first.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
