"""Is a target ready to run a config: doctor.py, prepare.py."""
