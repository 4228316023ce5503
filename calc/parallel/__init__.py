"""What one rank of a parallel layout holds and allocates, on the tape.

- ``layout``: how each rank holds weights, gradients, states, activations; the classes of ranks.
- ``data``: DDP gradient buckets and ZeRO-1 partitions.
- ``fsdp``: FSDP2 / ZeRO-3 shards, all-gathers, reshards and reduce-scatters.
- ``tensor``, ``sequence``: tensor and sequence parallelism (column/row splits, collectives).
- ``context``: context parallelism (analytic).
"""
