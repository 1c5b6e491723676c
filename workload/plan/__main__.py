"""`python -m workload.plan`: see memory.py."""

import sys

from workload.plan.memory import main

sys.exit(main())
