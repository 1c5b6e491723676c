"""Shared fixtures: the test bed of fake Proxmox VE nodes (see tests/testbed/).

- `testbed` (session): hosts pve1 and pve2, CTs 201 and 202 (ns) on pve1 and 301 (ns) on
  pve2, all running. Skips when not root; any other failure to start is an error.
- `make_container` (function): factory for extra CTs, destroyed after the test.
- `fresh_ct` (function): a new, empty, running ns CT on pve1.
- `lxc_ct` (session): a real LXC CT, 302 on pve2; skips with the reason when LXC can't be
  had (DFLASHOPS_TESTBED_LXC=require turns that into an error instead).
- Faults set with `host.set_faults(...)` are cleared after every test that used the bed.
- Tests marked `lxc` are skipped (with the reason) when LXC is unavailable.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

from tests.engines import building
from tests.testbed import LxcUnavailable, running

# OpenMP threads that wait for work sleep instead of spinning (libgomp, torch's runtime): a
# spinning thread burns the time slice its partner needs, and on shared or busy cores (the
# bed's sshd and trainers, a second test process, other jobs) tiny-model steps ran 7-30 times
# slower. Results are the same; set before any test imports torch, inherited by what tests run.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# pytest-xdist's workers (scripts/test.sh runs several) find COLUMNS=80 and LINES=24 in their
# environment, and the CLI sizes its tables by $COLUMNS when its output is not a terminal: the
# controller's own values (set or not) are handed to its workers and put back there.
_TERMINAL = ("COLUMNS", "LINES")
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["DFLASHOPS_TEST_TERMINAL"] = json.dumps({k: os.environ.get(k) for k in _TERMINAL})
    # whether the vLLM environment is still being built as the run starts, decided once here
    # and handed to the workers (each orders its collection the same way, or xdist stops)
    os.environ["DFLASHOPS_TEST_VLLM_BUILDING"] = str(int(building()))


def _terminal_as_the_controller_had_it() -> None:
    had = json.loads(os.environ.get("DFLASHOPS_TEST_TERMINAL", "{}"))
    for name in _TERMINAL:
        if had.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = had[name]


DEFAULT_CONTAINERS = {"pve1": (201, 202), "pve2": (301,)}
_vmids = itertools.count(900)


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        _terminal_as_the_controller_had_it()
    config.addinivalue_line("markers", "testbed: uses the fake Proxmox hosts (needs root)")
    config.addinivalue_line("markers", "lxc: needs real LXC containers (debootstrap rootfs)")


def _weight(item: pytest.Item) -> int:
    """About how long a test takes, in slow tests: a vLLM engine start (one or more, under
    load a minute each) is a few."""
    return 3 * _needs_vllm(item) + bool(item.get_closest_marker("slow"))


def _needs_vllm(item: pytest.Item) -> bool:
    return "vllm_python" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with the most long tests (marked slow, or starting a vLLM engine) first, each
    file's tests in their own order: xdist hands a worker a file at a time in this order, and a
    long file started last is a tail that one worker runs while the others are done. While the
    vLLM environment is still being built, each worker's first file is one that needs none."""
    files: dict[object, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    weight = {path: sum(_weight(i) for i in its) for path, its in files.items()}
    order = sorted(files, key=lambda p: -weight[p])
    if os.environ.get("DFLASHOPS_TEST_VLLM_BUILDING") == "1":
        n = str(getattr(config.option, "numprocesses", None) or 1)
        workers = max(1, int(n)) if n.isdigit() else 2
        free = [p for p in order if not any(_needs_vllm(i) for i in files[p])][:workers]
        order = free + [p for p in order if p not in free]
    items[:] = [i for path in order for i in files[path]]


@pytest.fixture(scope="session")
def testbed():
    """Fake Proxmox nodes pve1 and pve2 (real sshd, faithful pct) with CTs 201, 202, 301."""
    if os.geteuid() != 0:
        pytest.skip("the test bed needs root (network namespaces, sshd, LXC)")
    with running(DEFAULT_CONTAINERS) as bed:
        yield bed


@pytest.fixture(scope="session")
def lxc_ct(testbed):
    """A real LXC container: CT 302 on pve2."""
    try:
        return testbed["pve2"].add_container(302, "lxc")
    except LxcUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture
def make_container(testbed):
    """make_container(host="pve1", kind="ns", *, vmid=None, start=True, network=False)."""
    made = []

    def make(
        host: str = "pve1",
        kind: str = "ns",
        *,
        vmid: int | None = None,
        start: bool = True,
        network: bool = False,
    ):
        if kind == "lxc" and not testbed.lxc_available:
            pytest.skip(testbed.lxc_reason)
        if network and testbed.mode != "netns":
            pytest.skip("container networks need the test bed's netns mode")
        ct = testbed[host].add_container(vmid or next(_vmids), kind, start=start, network=network)
        made.append(ct)
        return ct

    yield make
    for ct in made:
        ct.host.remove_container(ct.vmid)


@pytest.fixture
def fresh_ct(make_container):
    """A new, empty, running ns container on pve1."""
    return make_container("pve1")


@pytest.fixture(autouse=True)
def _testbed_hygiene(request):
    if request.node.get_closest_marker("lxc"):
        bed = request.getfixturevalue("testbed")
        if not bed.lxc_available:
            pytest.skip(bed.lxc_reason)
    yield
    if "testbed" in request.fixturenames:
        bed = request.getfixturevalue("testbed")
        for host in bed.hosts.values():
            host.set_faults()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of a vLLM environment (tests/engines.py), else the test is skipped."""
    from tests.engines import require_vllm

    return require_vllm()
