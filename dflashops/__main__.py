"""`python -m dflashops`: the command line (cli.py)."""

from dflashops.cli import main

if __name__ == "__main__":
    main()
