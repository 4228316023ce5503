"""The model graphs: the op sequence of each implementation's forward, on the tape.

- ``shape``: `Shape`, the sizes and structure of one replayed step.
- ``reference``: plain PyTorch (``verify/models/reference.py``).
- ``hf``, ``hf_gpt2``, ``hf_inference``: Hugging Face transformers 5.24.
- ``hf_generate``: its ``generate`` (prefill and decode steps); ``hf_gpt2_cache``: GPT-2's
  forward over a KV cache.
- ``torchtune``: torchtune's Llama and its recipe's loss step
  (``verify/models/torchtune_llama.py``).
- ``attention``: which attention kernel runs; ``attention_core``: attention without a fused
  kernel (math SDPA and eager), written out of `calc.replay.ops`.
"""
