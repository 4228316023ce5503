"""Running a case: the training-step protocol, measuring it, comparing with calc, reports."""
