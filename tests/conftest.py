"""Test setup: Prefect runs against one session-wide test harness, with a temporary
PREFECT_HOME, analytics off and flow heartbeats off; nothing touches the user's ~/.prefect."""
from __future__ import annotations

import os
import tempfile

_PREFECT_HOME = tempfile.mkdtemp(prefix="drafter-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_RUNNER_HEARTBEAT_FREQUENCY", None)  # heartbeats off
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (startup timeout 120 s on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random target checkpoint in the embedded target's format (built once)."""
    from tests.helpers.targets import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny-target") / "model")


@pytest.fixture(scope="session")
def small_target(tmp_path_factory):
    """Bigger than the tiny target, so that generate and capture take long enough to be killed."""
    from tests.helpers.targets import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("small") / "model", num_layers=4, hidden_size=512,
                            intermediate_size=1024, num_heads=4, num_kv_heads=2, head_dim=128)


@pytest.fixture(scope="session")
def finished_store(tiny_target, tmp_path_factory):
    """A finished store: every stage up to ``gate`` run once per session on ``tiny_target`` with vLLM
    serving (ab_live has real numbers; quantize_fp8/verify_fp8 run on a stand-in FP8 release made from the
    forced-on bootstrap; quantize_exl3 is skipped without CUDA; ``gate.force`` is set). Returns
    ``{"cfg": ReleaseConfig, "store": Store, "inputs": {stage: Artifact}, "summary": run summary,
    "seconds": wall time}``; ``inputs`` holds every stage's finished (or skipped) output, ready for
    ``build_release_folder(cfg, inputs, out, ...)``. Needs the serving env (DRAFTER_SERVE_PYTHON)."""
    from drafter.serving.server import ServingError, serving_python
    from tests.helpers.finished_store import build_finished_store

    try:
        serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for the finished store (make test builds it): {e}")
    return build_finished_store(tiny_target, tmp_path_factory.mktemp("finished"))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `prefect server start` for the session, with the work pools and every deployment of
    deployments/prefect.yaml (tests/helpers/prefect_server.py); stopped by PID at the end."""
    from tests.helpers.prefect_server import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server-home")) as s:
        yield s


# `make test` runs the suite on pytest-xdist workers, a test file at a time (--dist loadfile), so that a module's
# fixtures are built once per worker; the files of a costly session fixture go to one worker together, which builds
# it once: the real Prefect server with every deployment (`server`) and the finished store. The scheduler below
# hands the work units out longest first, by the times of the last measured run (tests/data/test_durations.json,
# written by `python -m tests.durations`), so that the workers finish together. The order is a pure function of the
# collection and that file: the same on every run. The container tests run last of their unit: `make test` builds
# their images meanwhile. (xdist's own `loadgroup` groups nothing under pytest 9.2: pytest-xdist issue #1386.)
SHARED_FIXTURE_GROUPS = {"tests/test_deployments.py": "prefect-server", "tests/test_containers.py": "prefect-server",
                         "tests/test_card.py": "finished-store", "tests/test_publish.py": "finished-store"}
LAST_FILES = ("tests/test_containers.py",)


def pytest_collection_modifyitems(config, items):
    """The container tests run last (on two workers: last of their worker): `make test` builds their
    images while the other tests run."""
    items.sort(key=lambda item: item.nodeid.startswith(LAST_FILES))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with SHARED_FIXTURE_GROUPS, the longest work units first (tests/durations.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.durations import work_order

    class LongestFirstScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_FIXTURE_GROUPS.get(path, path)

        def schedule(self) -> None:
            # LoadScopeScheduling.schedule with the work queue in work_order (the indexes sent to a worker stay
            # those of its own collection)
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope in work_order(units, SHARED_FIXTURE_GROUPS):
                self.workqueue[scope] = units[scope]
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than files
                unused, _assigned = self.assigned_work.popitem()
                unused.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

        def _reschedule(self, node) -> None:
            # a worker runs a test once it knows the next one (for teardown), so a file is handed out when the worker
            # holds one test still to run (xdist's default, two, commits the next long file to a busy worker early)
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return LongestFirstScheduling(config, log)


def pytest_configure(config):
    from tests.durations import RunSummary

    if hasattr(config, "workerinput"):  # an xdist worker: torch gets its share of the cores (tests/helpers/torch_threads.py)
        from tests.helpers.torch_threads import share_the_cores

        share_the_cores(int(config.workerinput.get("workercount", 1)))
    else:  # the controller (or a run without xdist) prints the summary
        config.pluginmanager.register(RunSummary(), "drafter-run-summary")
