"""What one rank of a parallel layout holds and allocates, on the tape.

- ``data``: DDP gradient buckets and ZeRO-1 partitions.
- ``fsdp``: FSDP2 / ZeRO-3 shards, all-gathers, reshards and reduce-scatters.
- ``tensor``, ``sequence``: tensor and sequence parallelism (column/row splits, collectives).
- ``context``: context parallelism (analytic).
"""
