"""The fake Proxmox node: a faithful `pct`, and the helpers that start hosts and containers.

Stdlib only, and importable as the top-level package `fakepve`: these modules run under
/usr/bin/python3 in sshd sessions on the fake hosts (see ../run_fakepve.py).
"""
