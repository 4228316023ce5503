"""Test-suite settings: the web app's background compiling of neighbouring structures
(``webapp/prefetch.py``) is off, so each test spends its time on what it runs;
tests/webapp/test_prefetch.py switches it on where it checks it. The planner's disk cache goes
to a folder of this run (unless ``VRAMPLAN_CACHE_DIR`` is set), never the user's
``~/.cache/vramplan``."""

import os
import tempfile

os.environ.setdefault("VRAMPLAN_PREFETCH", "0")
os.environ.setdefault("VRAMPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="vramplan-tests-"))
