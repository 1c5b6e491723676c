"""Runs, and the other kinds of job started on targets, one module per job the package does.

- where a job lives and what was read of it: view.py (RunView, Progress), failure.py (why it
  failed, from its console)
- reading targets: probe.py (the client of remote/runs_probe.py: one call per target),
  survey.py (every target in parallel; a job by NAME, wherever it is)
- changing a job's directory: control.py (the client of remote/runctl.py)
- the kinds of job: job.py (JobKind: what a kind is), kind_training.py, kind_eval.py,
  kinds.py (every kind; the kind of a job read from a target)
- one lifecycle for every kind: placement.py (nodes, torchrun), claim.py (the name), snapshot.py
  (the code), start.py (launch.json, the launcher in tmux, the wait), stop.py, resume.py
- what starts each kind: launch.py (a training run: preflight, memory plan), evaljob.py (an eval
  job: pulls, then the job), with config.py (run.yaml and --set) and archive.py
- what readers show and stream: tables.py, watch.py (--follow), logs.py, evals.py (stored
  results), pulls.py (verified checkpoint copies)
"""
