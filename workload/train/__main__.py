"""`python -m workload.train`: starts loop.main."""

import sys

from workload.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
