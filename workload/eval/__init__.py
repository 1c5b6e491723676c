"""The evaluator: `python -m workload.eval` (evaluate.py), vLLM offline and served, parity."""
