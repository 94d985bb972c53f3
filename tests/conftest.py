"""Shared fixtures: a private fglit cache per test session, and the shared data root."""
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@pytest.fixture(scope="session")
def shared_root() -> Path:
    "The data root the tests read real datasets from (FGLIT_DATA, else ../shared/datasets)."
    root = Path(os.environ.get("FGLIT_DATA") or SHARED)
    if not root.is_dir():
        pytest.skip(f"no data root at {root}; set FGLIT_DATA")
    return root


@pytest.fixture
def simulator_threads():
    """Compute with fglit's simulation thread count (as `run` does), restored afterwards: hand-run clients match `run`.
    Denormal floats are not flushed here, though `run` flushes them (`cpu_compute`): hypothesis's float strategies refuse
    to run on a CPU that flushes them, and these short runs make none."""
    from fglit.core import cpu_threads
    with cpu_threads():
        yield


@pytest.fixture(scope="module")
def cora_parts(shared_root):
    "Cora and its 3-client Louvain partition (seed 0): the node-level algorithms' test clients."
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    return ds, partition(ds, "louvain", 3, seed=0)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    "An empty fglit cache for one test."
    cache = tmp_path / "cache"
    monkeypatch.setenv("FGLIT_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> Path:
    "An empty fglit cache shared by the tests of one module (`pytestmark = pytest.mark.usefixtures(\"module_cache\")`)."
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("cache")
        mp.setenv("FGLIT_CACHE", str(cache))
        yield cache


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="also run the tests marked gpu (needs CUDA)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs only with --gpu (make test-gpu)")
    config.addinivalue_line("markers", "slow: long-running")
    config.addinivalue_line("markers", "long: minutes of processes on loopback; left out of `make test` (its 25-minute budget), run by `make test-long`")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="needs --gpu (make test-gpu on a CUDA machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With FGLIT_TEST_LOG set, write each test's outcome (and a failure's traceback) as it happens, so a run cut off
    by a time limit (a lent GPU machine's call) still tells which tests failed and why."""
    path = os.environ.get("FGLIT_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and not report.failed):   # xdist: the controller writes
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} [{report.when}] {report.duration:.1f}s\n")
        if report.failed:
            f.write(report.longreprtext[-4000:] + "\n---\n")


@pytest.fixture(autouse=True)
def _denormal_mode_restored():
    "Every test leaves this thread's CPU as it found it, not flushing denormal floats to zero (hypothesis's float strategies, and users' code, rely on that)."
    yield
    from fglit.core import denormals_flushed
    assert not denormals_flushed(), "this test left the CPU flushing denormal floats to zero (fglit.core.flush_denormals not undone)"
