"""``python -m calc``: the command-line calculator (display only).

- ``main``: one estimate; ``plan``: ``python -m calc plan``; ``report``: ``python -m calc report``.
- ``compression``, ``prune_distill``: their options; ``model_source``: --card/--config;
  ``exits``: the status and the one-line error a command ends with.
"""
