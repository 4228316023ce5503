"""``python -m calc``: see ``calc.cli.main``."""

from calc.cli.main import main

raise SystemExit(main())
