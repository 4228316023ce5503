"""``python -m calc``: see ``calc.cli``."""

from calc.cli import main

raise SystemExit(main())
