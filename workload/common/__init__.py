"""Small helpers every program of the workload shares (no torch)."""
