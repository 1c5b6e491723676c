"""Data generation: the target answers a chat corpus again (`python -m workload.datagen`)."""
