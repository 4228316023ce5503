"""Context parallelism: the sequence of every activation split over ``cp`` ranks (analytic).

Context parallelism (Megatron-LM ``--context-parallel-size``; Liu et al. 2023, "Ring
Attention"; PyTorch ``torch.distributed.tensor.experimental.context_parallel``) gives each of
``cp`` ranks ``s / cp`` tokens of every sequence; parameters, gradients and optimizer states
are replicated over cp (gradients are all-reduced like data parallelism). Attention needs every
key and value: ring attention passes the K/V chunks around the ring, each rank holding its own
chunk and the one in flight.

So a rank runs the single-GPU step at sequence length ``s / cp`` (`rank_job`: every activation
divided by cp, as Korthikanti et al. 2022 divide activations by the parallel degree), plus the
K/V chunks received from the ring (`ring_kv_bytes`). This module is **analytic**: no engine
runs it on verify's CPU backend (tried with torch 2.13 on gloo: ``context_parallel`` raises
"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered"; it supports the CUDA flash/efficient/cuDNN SDPA kernels), so it is not
verified by a measurement; ``calc.estimate`` says so in its notes.
"""

from __future__ import annotations

from dataclasses import replace

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.replay.tape import round_block

KV_CHUNKS_IN_FLIGHT = 2
"""Received K/V chunks held at once: the one attention uses and the one arriving (double
buffering of ring attention's send/recv; Liu et al. 2023 §3)."""


def rank_job(job: Training, parallel: Parallelism) -> Training:
    """The job one context-parallel rank runs: ``seq_len / cp`` tokens per sequence.

    Raises ``ValueError`` when cp does not divide the sequence (load-balanced causal CP needs
    ``2 * cp`` equal chunks: Megatron-LM and PyTorch both split the sequence into ``2 * cp``)."""
    cp = parallel.cp
    if cp == 1:
        return job
    if job.seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={job.seq_len} must be a multiple of 2 * cp = {2 * cp} (context "
            "parallelism splits each sequence into 2 * cp load-balanced chunks)"
        )
    return replace(job, seq_len=job.seq_len // cp)


def ring_kv_bytes(model: ModelSpec, rank_job: Training) -> int:
    """Bytes of the K/V chunks a rank holds from the ring beyond its own: `KV_CHUNKS_IN_FLIGHT`
    x (K and V) x ``[b, kv_heads, s / cp, head_dim]`` (``rank_job.seq_len`` is already
    ``s / cp``; ``model`` is the rank's, kv heads divided by tp) in the activations' dtype
    (2 B under autocast or bf16, else 4 B), each rounded to 512 B; one attention layer at a
    time."""
    itemsize = 4 if rank_job.precision == "fp32" else 2
    chunk = rank_job.micro_batch * model.n_kv_heads * rank_job.seq_len * model.head_dim
    return KV_CHUNKS_IN_FLIGHT * 2 * round_block(chunk * itemsize)
