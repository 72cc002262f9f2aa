import os
import sys

import pytest

# On a machine with several GPUs (NORMKIT_TEST_GPUS=n, set by scripts/gpu-check.sh), pytest-xdist
# worker k sees only GPU k % n, so the workers' compiles and launches spread over the GPUs. This must
# happen before torch or JAX initialize CUDA, i.e. here, when a worker first imports the conftest.
_gpus, _worker = os.environ.get("NORMKIT_TEST_GPUS"), os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus and int(_gpus) > 1 and _worker.startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(_gpus))

# On the CPU, most of a JAX test's time is XLA compiling small programs with LLVM's optimizations:
# compile them without (as test_pallas_impl's own functions do), before JAX starts. The results are
# checked against float64 within the tolerance table, which holds either way; the GPU run keeps XLA's
# defaults. Processes a test starts as a user would (the notebooks) get the user's XLA_FLAGS back:
# ``user_xla_flags``.
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get("NORMKIT_TEST_SHAPES", "ci") != "gpu" and CPU_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), CPU_XLA_FLAGS]))


@pytest.fixture
def user_xla_flags(monkeypatch) -> None:
    """XLA_FLAGS as it was before this conftest added ``CPU_XLA_FLAGS`` (unset if it was)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(CPU_XLA_FLAGS, "").strip()
    if flags:
        monkeypatch.setenv("XLA_FLAGS", flags)
    else:
        monkeypatch.delenv("XLA_FLAGS", raising=False)

from tests.frontends import FRONTENDS


@pytest.fixture(params=sorted(FRONTENDS))
def frontend(request):
    return FRONTENDS[request.param]()


@pytest.fixture(autouse=True)
def _trip_state_reset():
    """No test leaks the Torch frontend's process-wide state into the next test run by its worker: the
    rms_norm_rope switch (``_bound.ROPE_TABLES_KEEP_X``, set once a forward met rotary tables that are not
    rotations), a set tables' flag, or a weight's trip flag no call has read (which would make the next
    test's first remembered choice be made again): ``_bound.reset()`` after any test that left one on."""
    yield
    bound = sys.modules.get("torch_frontend._bound")
    if bound is not None and (bound.rope_tables_state_set() or bound.weight_tripped_unread()):
        bound.reset()


def pytest_runtest_logreport(report):
    """With NORMKIT_FAILURE_LOG set, each failure is appended to that file as it happens (also under
    pytest-xdist, where the controller receives the reports), so a run killed by a time limit still
    names what failed."""
    path = os.environ.get("NORMKIT_FAILURE_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist, only the controller writes
        return
    if report.failed:
        with open(path, "a") as fh:
            fh.write(f"FAILED {report.nodeid} [{report.when}]\n{report.longreprtext[-4000:]}\n\n")
    if report.when == "call" or report.failed or report.skipped:  # every test's outcome and time, as it ends
        with open(os.path.splitext(path)[0] + ".outcomes.txt", "a") as fh:
            fh.write(f"{report.outcome} {report.duration:.2f} {report.nodeid}\n")
