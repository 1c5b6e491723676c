"""What readers show and stream: status_tables.py, status_follow.py, log_stream.py, alarms.py,
wandb_alert.py."""
