#!/usr/bin/python3 -IS
"""Entry point of the fake hosts' helper processes; run it with /usr/bin/python3 -IS."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fakepve.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
