"""`python -m workload.datagen`: the program lives in workload/data/datagen/generate.py (this module only starts it)."""

import sys

from workload.data.datagen.generate import main

if __name__ == "__main__":  # vLLM's engine core is a spawned process: it needs this guard
    sys.exit(main())
