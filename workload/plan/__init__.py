"""Will it fit: `python -m workload.plan`, memory per rank and step time."""
