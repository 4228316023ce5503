"""How a command ends: its status and, on failure, one line on stderr (never a traceback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from calc.derive.replay import RecorderMissing

BAD_INPUT = 2
"""The status for input calc refuses and for a valid job the cost model does not cover yet."""


def run_reporting_errors(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``; a ``ValueError`` (bad input) prints ``error: ...`` and a
    ``NotImplementedError`` (not modelled yet) ``not supported yet: ...`` (``error: ...`` when
    only torch and transformers are missing: `RecorderMissing`), a job too large for
    this machine (``MemoryError``, ``OverflowError``, ``RecursionError``) ``error: ...``, all
    returning `BAD_INPUT`."""
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except RecorderMissing as exc:  # modelled, by a recording this install cannot make
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except NotImplementedError as exc:
        print(f"not supported yet: {exc}", file=sys.stderr)
        return BAD_INPUT
    except (MemoryError, OverflowError, RecursionError) as exc:
        kind = type(exc).__name__
        print(
            f"error: this job is too large to compute ({kind}); use smaller sizes", file=sys.stderr
        )
        return BAD_INPUT
