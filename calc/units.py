"""Binary byte units (the lowest module of ``calc``: it imports nothing).

Bytes stay bytes inside the cost model; these convert at the edges: a configured size given in
MiB (DDP's ``bucket_cap_mb``) and GiB at display.
"""

MIB = 1 << 20
"""Bytes per MiB (2**20)."""
GIB = 1 << 30
"""Bytes per GiB (2**30): the only unit used for display."""
