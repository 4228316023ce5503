"""``python -m calc``: the command-line calculator (display only).

- ``main``: one estimate; ``plan``: ``python -m calc plan``; ``report``: ``python -m calc report``.
- ``compression``, ``prune_distill``: their options.
"""
