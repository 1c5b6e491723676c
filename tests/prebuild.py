"""Build what the tests keep in their cache ($DFLASHOPS_TEST_CACHE: the tiny targets, the
trained tiny drafter) before they ask for it. scripts/setup-dev.sh starts this in the
background once .venv has torch, so on a fresh machine the builds use the minutes spent waiting
for the vLLM environment. Each build is the tests' own, keyed and locked as theirs: a test that
asks for one still being built here waits for it; one already there is not built again.

    .venv/bin/python -m tests.prebuild
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tests/conftest.py sets it


def main() -> None:
    from tests.operator.tiny_target import tiny_build
    from tests.workload.conftest import FIXTURE_BUILDS, cached_tiny
    from tests.workload.drafters import trained_drafter

    def made(what: str, build):  # noqa: ANN001, ANN202
        t0 = time.time()
        path = build()
        print(f"prebuild: {what}: {path} ({time.time() - t0:.0f} s)", flush=True)
        return path

    dense = made("tiny dense target", lambda: cached_tiny(FIXTURE_BUILDS["dense"]))
    made("trained tiny drafter", lambda: trained_drafter(dense))
    made("the bed's tiny target", tiny_build)
    made("tiny hybrid target", lambda: cached_tiny(FIXTURE_BUILDS["hybrid"]))


if __name__ == "__main__":
    main()
