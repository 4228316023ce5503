"""Test-suite settings: the web app's background compiling of neighbouring structures
(``webapp/prefetch.py``) is off, so each test spends its time on what it runs;
tests/webapp/test_prefetch.py switches it on where it checks it."""

import os

os.environ.setdefault("VRAMPLAN_PREFETCH", "0")
