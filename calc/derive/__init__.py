"""``calc.derive``: the replay of any Hugging Face ``*ForCausalLM``, derived from its modeling code.

- ``book``: the storage bookkeeping with the rules of verify's CPU tracker (a dispatch mode);
- ``record``: the real model built on fake tensors and run through verify's protocol (torch
  and transformers imported only in these two modules, late);
- ``lift``: the sizes at a few (batch, sequence[, context]) points fitted to exact polynomials
  of ``b``, ``s``, ``c``; the job's regime (which side of a window each size is on);
- ``replay``: the fitted stream played on a tape as calc events (cached on disk), which the
  timeline and the compile take like a hand-written replay's.
"""
