"""One lifecycle for every kind of job: job_kind.py, kinds.py, placement.py, claim.py, hold.py,
snapshot.py, start.py, stop.py, resume.py, archive.py, control.py, rehearse.py."""
