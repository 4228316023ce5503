"""The model graphs: the op sequence of each implementation's forward, on the tape.

- ``reference``: plain PyTorch (``verify/models/reference.py``).
- ``hf``, ``hf_gpt2``, ``hf_inference``, ``hf_ops``: Hugging Face transformers 5.24.
- ``attention``: which attention kernel runs; ``attention_core``: attention without a fused kernel.
"""
