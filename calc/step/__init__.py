"""One training step or one inference pass, replayed phase by phase.

- ``training``: forward, backward and optimizer steps of a training job.
- ``optimizer``: the optimizer phase (states, foreach/fused temporaries).
- ``inference``: a prefill into a KV cache.
- ``pipeline``: one pipeline stage's step under torch.distributed.pipelining's schedules.
"""
