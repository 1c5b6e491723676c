"""Runs and the other jobs started on targets, one module per job they do (see the operator's
design page in docs/): where a job lives and its view (view.py), reading targets (probe.py,
survey.py), changing a job's directory (control.py), placing, claiming, snapshotting, starting,
waiting, stopping and resuming it (placement.py, claim.py, snapshot.py, start.py, stop.py,
resume.py), the kinds of job (job.py, kinds.py and one module per kind), and what the reading
commands show of them (tables.py, watch.py, logs.py, evals.py, pulls.py)."""
