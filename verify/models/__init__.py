"""What a case runs: the reference and Hugging Face models, optimizers, compression, pruning, distillation."""
