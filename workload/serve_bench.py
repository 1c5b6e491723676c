"""`python -m workload.serve_bench`: the program lives in workload/eval/serve.py (this module only starts it)."""

import sys

from workload.eval.serve import main

if __name__ == "__main__":
    sys.exit(main())
