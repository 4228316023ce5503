"""What the calculator shows: display rows (GiB, shares, symbols) and sweeps."""
