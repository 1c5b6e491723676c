"""`python -m workload.eval`: starts evaluate.main."""

import sys

from workload.eval.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
