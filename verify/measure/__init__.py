"""Measuring: the CPU storage tracker (a stand-in for ``torch.cuda.max_memory_allocated``) and allocation traces."""
