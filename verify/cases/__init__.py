"""The verification cases, as plain data: a card, how to scale it, a job, a tolerance."""
