"""The training run: kind.py, launch.py, config.py, parity.py."""
