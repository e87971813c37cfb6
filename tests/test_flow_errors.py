"""Failures INSIDE the release flow, through the real command line (`drafter release` in a subprocess with a
local Prefect API server): the terminal shows Prefect's progress lines but exactly one `error: …` line and no
traceback; the traceback goes to the log file that line names; the exit code follows the error's own class
(2 for bad input and permission errors, also when a stage raised it and the flow wrapped it), and nothing
partial is left in the store. (tests/test_bad_input.py covers what preflight refuses before the flow; the tampered
store's refusal, which comes before Prefect starts, runs `drafter release` in process.)"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from drafter.core.config import load_config
from tests.test_bad_input import DIRECTIVE, _fake_output, ckpt, leftovers, write_config  # noqa: F401 — ckpt: fixture

REPO = Path(__file__).resolve().parents[1]
CLI = "from drafter.cli import main; main()"


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    """One Prefect home for the module: its database is created once (slow on two busy cores)."""
    return tmp_path_factory.mktemp("prefect-home")


def drafter(*args, cwd: Path, prefect_home: Path, code: str = CLI, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(prefect_home),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DRAFTER_PREFECT_STARTUP_TIMEOUT": "600"}
    env.pop("PREFECT_API_URL", None)  # the run starts its own temporary server
    return subprocess.run([sys.executable, "-c", code, "release", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600, preexec_fn=preexec_fn)


def one_error_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Exit ``code``; no traceback on the terminal; exactly one line starting with `error:`, last on stderr, naming
    ``needles`` and what to do, and the log file that holds the traceback."""
    terminal = r.stdout + r.stderr
    assert r.returncode == code, terminal[-4000:]
    assert "Traceback" not in terminal and 'File "' not in terminal, terminal[-4000:]
    errors = [ln for ln in terminal.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, terminal[-4000:]
    line = errors[0]
    assert r.stderr.rstrip().splitlines()[-1] == line, r.stderr[-2000:]
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    assert DIRECTIVE.search(line), f"no 'what to do' in {line!r}"
    m = re.search(r"\(the traceback: (\S+\.log)\)$", line)
    assert m, line
    log = Path(m.group(1)).read_text()
    assert "Traceback (most recent call last)" in log, log[-2000:]
    return line


def config(tmp_path: Path, ckpt: Path, **sections) -> Path:
    """tests/test_bad_input.py's config with quantize_exl3 off: every plan (each `drafter` process) would otherwise
    probe this interpreter for CUDA in a subprocess of its own, for a stage none of these runs reaches."""
    return write_config(tmp_path, ckpt, quantize_exl3={"enabled": False}, **sections)


# ------------------------------------------------------------------------------------- a store the user cannot write


def _drop_root_file_powers() -> None:
    """preexec_fn as root: the child (and what it execs) loses CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so a
    directory's mode bits refuse it as they refuse any user (root otherwise writes anywhere)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _as_a_user_mode_bits_refuse():
    """None when not root; else the preexec_fn above, if it makes mode bits refuse root here (else skip)."""
    if os.geteuid() != 0:
        return None
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"drafter-ro-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    probe.chmod(0o500)
    try:
        r = subprocess.run([sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"], capture_output=True,
                           preexec_fn=_drop_root_file_powers)
    except (OSError, subprocess.SubprocessError):
        r = None
    finally:
        probe.chmod(0o700)
        (probe / "x").unlink(missing_ok=True)
        probe.rmdir()
    if r is None or r.returncode == 0 or b"PermissionError" not in r.stderr:
        pytest.skip("root writes anywhere (and cannot drop CAP_DAC_OVERRIDE here)")
    return _drop_root_file_powers


def test_stage_directory_not_writable_refused_once_named_exit_2(tmp_path, ckpt, prefect_home):
    """A stage directory this user cannot write: refused at once (no retry), exit 2, one line naming the
    directory and the remedy, no traceback on the terminal, nothing partial left. Today: `PermissionError: …
    .lock` inside a RuntimeError, exit 1, with Prefect's tracebacks."""
    preexec = _as_a_user_mode_bits_refuse()
    store = tmp_path / "store"
    stage_dir = store / "prepare_target"
    stage_dir.mkdir(parents=True)
    stage_dir.chmod(0o500)
    c = config(tmp_path, ckpt)
    try:
        r = drafter("-c", c, "--stage", "prepare_target", cwd=tmp_path, prefect_home=prefect_home, preexec_fn=preexec)
    finally:
        stage_dir.chmod(0o700)
    line = one_error_line(r, 2, str(stage_dir), "make it writable by this user", "store.root")
    assert "PermissionError" not in line or "Permission denied" in line
    assert "Retry" not in r.stdout + r.stderr, "a permission error was retried"
    assert leftovers(store) == [] and not list(stage_dir.iterdir())


# ------------------------------------------------------------------------------------- bad input found by a stage


RAISE_IN_STAGE = """
from drafter.core.errors import BadInputError
import drafter.stages.prepare_target as stage

def refuse(path):  # what a stage does when the user's input is wrong (the checks before the flow passed)
    raise BadInputError(f"prepare_target.path: {path} holds no weights the stage can read; point it at the checkpoint")

stage.resolve_path_target = refuse
from drafter.cli import main; main()
"""


def test_bad_input_raised_by_a_stage_exits_2_with_one_line(tmp_path, ckpt, prefect_home):
    """A BadInputError raised by a stage inside the flow (wrapped by the flow for its summary): exit 2 as the
    same error before the flow, one line with its message, no traceback, not retried, nothing partial left.
    Today: exit 1 (the flow's RuntimeError decided) and Prefect's tracebacks on the terminal."""
    store = tmp_path / "store"
    c = config(tmp_path, ckpt)
    r = drafter("-c", c, "--stage", "prepare_target", cwd=tmp_path, prefect_home=prefect_home, code=RAISE_IN_STAGE)
    one_error_line(r, 2, f"prepare_target.path: {ckpt} holds no weights", "failed at prepare_target")
    assert "Retry" not in r.stdout + r.stderr
    assert leftovers(store) == [] and not list((store / "prepare_target").glob(".*.partial"))


# ------------------------------------------------------------------------------------- a corrupt store file


def test_tampered_store_output_is_found_before_the_flow_in_one_line(tmp_path, ckpt, monkeypatch):
    """An output whose file has the right size but not its sha256: preflight verifies the outputs it finds
    (once per process: the flow does not hash them again), so the run stops before the flow starts — exit 1 (an
    inconsistent store), one line naming the file and what to do, no traceback. (`drafter release` in process:
    it stops in its checks, before any Prefect server or flow; the subprocess path of the one error line is the
    other tests'.)"""
    from drafter_prefect import api_server
    from tests.test_bad_input import cli

    def no_server(*a, **k):
        raise AssertionError("a Prefect API server was started for a run its checks refused")

    monkeypatch.setattr(api_server, "prefect_api", no_server)
    c = config(tmp_path, ckpt)
    d = _fake_output(tmp_path / "store", load_config(c), "prepare_target", {"target.json": b"{}"})
    r = cli("release", "-c", c, "--stage", "prepare_target")
    terminal = r.output
    assert r.exit_code == 1, terminal[-4000:]
    assert "Traceback" not in terminal and "Beginning flow run" not in terminal, terminal[-4000:]
    errors = [ln for ln in terminal.splitlines() if ln.startswith("error:")]
    assert errors == [r.stderr.rstrip().splitlines()[-1]], terminal[-4000:]
    for needle in ("target.json", "sha256", f"remove {d} to recompute it"):
        assert needle in errors[0]


# ------------------------------------------------------------------------------------- runner: containers


def test_missing_deployments_name_prefect_api_url_and_the_deploy_command(tmp_path, ckpt, prefect_home):
    """runner: containers without PREFECT_API_URL: the run's temporary server has no deployments; the one line
    names them, PREFECT_API_URL and the deploy command; exit 2; no traceback."""
    c = config(tmp_path, ckpt, runner={"kind": "containers"})
    r = drafter("-c", c, "--stage", "prepare_target", cwd=tmp_path, prefect_home=prefect_home)
    one_error_line(r, 2, "stage-prepare-target/docker", "PREFECT_API_URL",
                   "prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml")
    assert leftovers(tmp_path / "store") == []
