"""The datagen job: kind.py, job.py."""
