"""A test bed of real hosts: fake Proxmox VE nodes (sshd + a faithful pct) with containers.

See bed.TestBed; tests get one through the `testbed` fixture in tests/conftest.py.
"""

from .bed import LxcUnavailable, TestBed, running
from .container import Container
from .host import Host
from .slots import TestBedError
from .sshclient import SSHResult

__all__ = ["Container", "Host", "LxcUnavailable", "SSHResult", "TestBed", "TestBedError", "running"]
