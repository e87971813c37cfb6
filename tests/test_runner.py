"""`runner: containers` without containers: the config, what a child flow run is given, the preflight
refusal of secret values, the container a manifest names, and the Dockerfile check of the CUDA images."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drafter.core.config import config_from_dict
from drafter.core.errors import BadInputError, ConfigError
from drafter.core.hardware import container

ROOT = Path(__file__).resolve().parents[1]

PODMAN_MOUNTINFO = (
    "86 80 254:0 /run/containers/storage/overlay-containers/f019597cb0097a36cbca8d53cea7048a27b6d615dfb466821b23883469c6f238"
    "/userdata/resolv.conf /etc/resolv.conf rw,relatime - ext4 /dev/vda rw\n"
    "90 80 254:0 /run/containers/storage/overlay-containers/f019597cb0097a36cbca8d53cea7048a27b6d615dfb466821b23883469c6f238"
    "/userdata/hostname /etc/hostname rw,relatime - ext4 /dev/vda rw\n")
DOCKER_MOUNTINFO = (
    "612 590 8:1 /var/lib/docker/containers/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef/hostname "
    "/etc/hostname rw,relatime - ext4 /dev/sda1 rw\n")


def test_the_runner_setting_its_shorthand_and_its_checks():
    assert config_from_dict({}).runner.kind == "local"
    cfg = config_from_dict({"runner": "containers"})
    assert cfg.runner.kind == "containers" and cfg.runner.deployment == "stage-{stage}/docker"
    with pytest.raises(ConfigError, match=r"runner.deployment must contain \{stage\}"):
        config_from_dict({"runner": {"deployment": "stage-x/docker"}})
    with pytest.raises(ConfigError, match=r"unknown stage\(s\) \['trian'\]"):
        config_from_dict({"runner": {"deployments": {"trian": "stage-train/docker-gpu"}}})
    with pytest.raises(ConfigError, match="is not FLOW/DEPLOYMENT"):
        config_from_dict({"runner": {"deployments": {"train": "docker-gpu"}}})


def test_each_stage_goes_to_its_deployment_with_a_local_runner_and_only_env_references():
    from drafter_prefect.containers import child_config, deployment_for

    cfg = config_from_dict({"runner": {"kind": "containers", "deployments": {"train": "stage-train/docker-gpu"}},
                            "serving": {"env": {"HF_TOKEN": "${HF_TOKEN}"}}})
    assert deployment_for(cfg, "quantize_fp8") == "stage-quantize-fp8/docker"
    assert deployment_for(cfg, "train") == "stage-train/docker-gpu"
    child = child_config(cfg)
    assert child["runner"] == {"kind": "local"} and child["serving"]["env"] == {"HF_TOKEN": "${HF_TOKEN}"}
    # the child's config is the parent's: same stage keys
    from drafter.core.pipeline import plan

    assert {p.stage.name: p.key for p in plan(config_from_dict(child))} == {p.stage.name: p.key for p in plan(cfg)}


def test_preflight_refuses_a_secret_value_in_serving_env_for_containers(tmp_path):
    from drafter.data.preflight import _check_serving

    cfg = config_from_dict({"runner": "containers", "serving": {"env": {"HF_TOKEN": "hf_secret", "X": "${X}"}}})
    with pytest.raises(BadInputError, match=r"serving.env.HF_TOKEN holds a value.*\$\{HF_TOKEN\}") as e:
        _check_serving(cfg, ["generate"])
    assert "hf_secret" not in str(e.value)
    _check_serving(config_from_dict({"runner": "containers", "serving": {"env": {"X": "${X}"}}}), ["generate"])


def test_the_container_a_process_runs_in_from_its_mounts(monkeypatch):
    monkeypatch.setenv("DRAFTER_IMAGE", "drafter-release:project")
    c = container(PODMAN_MOUNTINFO)
    assert c["id"] == "f019597cb0097a36cbca8d53cea7048a27b6d615dfb466821b23883469c6f238"
    assert c["image"] == "drafter-release:project"
    assert container(DOCKER_MOUNTINFO)["id"] == "0123456789abcdef" * 4
    if not Path("/.dockerenv").exists() and not Path("/run/.containerenv").exists():
        assert container("") is None  # not in a container


def test_the_cuda_dockerfiles_are_checked_and_said_not_built(tmp_path):
    r = subprocess.run([sys.executable, "deployments/check_dockerfile.py", "--cuda", "deployments/Dockerfile.train",
                        "deployments/Dockerfile.exl3"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Dockerfile.train: checked; not built here" in r.stdout and "nvidia/cuda" in r.stdout
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM nvidia/cuda:12.8.1-devel-ubuntu22.04\nCOPY nowhere /x\nCOPY tests /t\n")
    r = subprocess.run([sys.executable, "deployments/check_dockerfile.py", str(bad)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 1
    assert "FROM nvidia/cuda:12.8.1-devel-ubuntu22.04 is fixed" in r.stderr
    assert "nowhere does not exist in the build context" in r.stderr
    assert "tests is excluded by .dockerignore" in r.stderr
