"""Runs, and the other kinds of job started on targets, in one sub-package per group:

- reading/: where a job lives and what was read of it: view.py (RunView, Progress),
  failure.py (why it failed, from its console), probe.py (the client of remote/runs_probe.py:
  one call per target), survey.py (every target in parallel; a job by NAME, wherever it is)
- lifecycle/: one lifecycle for every kind of job: job_kind.py (JobKind: what a kind is),
  kinds.py (every kind; the kind of a job read from a target), placement.py (nodes, torchrun),
  claim.py (the name), hold.py (who holds a run while it starts), snapshot.py (the code),
  start.py (launch.json, the launcher in tmux, the wait), stop.py, resume.py, archive.py,
  control.py (the client of remote/runctl.py), rehearse.py (what --dry-run checks here)
- training/: the training run: kind.py, launch.py (preflight, memory plan), config.py (run.yaml
  and --set), parity.py (`check`)
- evaluation/: eval jobs and their results: kind.py, job.py (pulls, then the job), pulls.py
  (verified checkpoint copies), results.py (stored results), fingerprints.py (the settings
  behind a tau, compared), serving.py and serving_table.py (`eval --serve`), and the continuous
  eval: continuous_kind.py, continuous.py (its start and its checkpoint server),
  continuous_cli.py (started and reported by `eval --every` and `launch --eval-on`),
  prompt_sets.py (the benchmark sets by name, fetched in a target: `fetch-prompts`)
- datagen/: the datagen job: kind.py, job.py (start, follow, combine)
- watching/: what readers show and stream: status_tables.py, status_follow.py (`status
  --follow`), log_stream.py (`logs`), alarms.py and wandb_alert.py (`watch`)
- readiness/: is a target ready: doctor.py (`doctor`'s verdicts), prepare.py (`setup`'s system
  packages)
- export/: a checkpoint made a directory servers load (`export`): drafter.py (what it holds,
  its verified copy), card.py (the model card and the serving lines)
"""
