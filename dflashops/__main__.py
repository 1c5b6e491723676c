"""`python -m dflashops`: the command line (cli.py)."""

from dflashops.cli import main

main()
