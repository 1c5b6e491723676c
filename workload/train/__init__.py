"""The trainer: `python -m workload.train` (the loop in loop.py) and what only training uses."""
