"""`python -m workload.train`: see loop.py."""

import sys

from workload.train.loop import main

sys.exit(main())
