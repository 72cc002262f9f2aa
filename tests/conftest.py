import os

import pytest

from tests.frontends import FRONTENDS


@pytest.fixture(params=sorted(FRONTENDS))
def frontend(request):
    return FRONTENDS[request.param]()


def pytest_runtest_logreport(report):
    """With NORMKIT_FAILURE_LOG set, each failure is appended to that file as it happens (also under
    pytest-xdist, where the controller receives the reports), so a run killed by a time limit still
    names what failed."""
    path = os.environ.get("NORMKIT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as fh:
            fh.write(f"FAILED {report.nodeid} [{report.when}]\n{report.longreprtext[-4000:]}\n\n")
