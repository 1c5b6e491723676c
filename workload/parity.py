"""`python -m workload.parity`: the program lives in workload/eval/parity.py (this module only starts it)."""

import sys

from workload.eval.parity import main

if __name__ == "__main__":
    sys.exit(main())
