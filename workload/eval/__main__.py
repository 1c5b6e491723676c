"""`python -m workload.eval`: see evaluate.py."""

import sys

from workload.eval.evaluate import main

sys.exit(main())
