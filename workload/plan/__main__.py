"""`python -m workload.plan`: starts memory.main."""

import sys

from workload.plan.memory import main

if __name__ == "__main__":
    sys.exit(main())
