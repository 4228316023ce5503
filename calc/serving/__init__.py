"""Serving capacity: what a vLLM server holds per GPU once it has started.

``calc.serve(model, calc.Serving(...), gpu=...)`` predicts the terms vLLM logs at start-up
(weights, non-torch memory, the profiling run's activation peak, CUDA graphs, the KV cache, its
blocks, tokens and the maximum concurrency):

* ``engine``: the engine (V0/V1) and the defaults of each vLLM version;
* ``weights``: the weight bytes one rank loads ("Model loading took ...");
* ``kv_cache``: page sizes, blocks, tokens and concurrency (``vllm/v1/core/kv_cache_utils.py``);
* ``profile``: the profiling run's activation peak (calc's replay of the forward plus vLLM's
  sampler), the memory outside PyTorch and the CUDA graphs;
* ``api``: ``serve`` and its result, ``ServeEstimate``.
"""
