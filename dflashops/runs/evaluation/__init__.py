"""Eval jobs, continuous evals and their results: kind.py, job.py, pulls.py, results.py,
fingerprints.py, serving.py, serving_table.py, continuous_kind.py, continuous.py,
continuous_cli.py."""
