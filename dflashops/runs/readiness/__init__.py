"""Is a target ready to run a config: doctor.py, prepare.py; the model it needs: hub.py."""
