"""``calc.plan``: the capacity planner. Which configurations of a job fit on which GPUs?

- ``planner``: `plan`, `evaluate`, `least_hardware`, `changes_to_fit`.
- ``axes``, ``layouts``, ``engine``, ``search``, ``result``: the grid, its evaluation and results.
- ``grid``, ``grid_eval``, ``program``: compiled structures as data, vectorised over the grid.
- ``throughput``, ``evidence``, ``report``: ranking, error bars, the least-memory report.
"""
