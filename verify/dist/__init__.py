"""Distributed verification: torchrun (gloo) launches, the parallel engines that wrap each rank's
model, and the per-rank comparison with ``calc.estimate``."""
