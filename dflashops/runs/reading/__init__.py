"""Where a job lives and what was read of it: view.py, failure.py, probe.py, survey.py."""
