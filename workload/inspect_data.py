"""`python -m workload.inspect_data`: the program lives in workload/data/inspect_rows.py (this module only starts it)."""

import sys

from workload.data.inspect_rows import main

if __name__ == "__main__":
    sys.exit(main())
