"""The memory plan (drafter/training/memory.py, `drafter plan`): DeepSeek-V3's MTP layer built at its real
dimensions on the meta device and counted under the default freeze, the plan's terms against those counts,
and `drafter plan` on both seed configs without weights and without network."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from drafter.core.config import load_config
from drafter.training import memory
from drafter.training.memory import GiB

ROOT = Path(__file__).resolve().parents[1]
V3 = ROOT / "configs/deepseek-v3-mtp.yaml"
V41 = ROOT / "configs/deepseek-v4.1-flash-dspark.yaml"


@pytest.fixture(scope="module")
def v3_plan():
    cfg = load_config(V3)
    tc = memory.shipped_target_config(cfg.prepare_target.hub_id)
    assert tc is not None and "deepseek-v3-0324.config.json" in tc.source
    return cfg, {d: memory.plan_for_config(cfg, tc, frozen_dtype=d) for d in ("float32", "bfloat16")}


def test_v3_mtp_layer_counted_at_real_size_on_meta(v3_plan):
    """13.46 B parameters (the MTP layer's own embedding and shared head included), 11.27 B in routed
    experts, 336 M trainable under the default freeze (embed_tokens, routed experts, shared_head.head)."""
    cfg, plans = v3_plan
    pc = plans["float32"].drafter.params
    assert pc.total == 13_463_426_048
    assert pc.routed_experts == 11_274_289_152
    assert pc.trainable == 335_778_816
    assert pc.vocab_tables == 2 * 129_280 * 7168  # embed_tokens + shared_head.head, both frozen
    assert cfg.train.freeze == ["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"]


def test_v3_plan_terms_follow_the_counts(v3_plan):
    cfg, plans = v3_plan
    p32, p16 = plans["float32"], plans["bfloat16"]
    pc = p32.drafter.params
    lines = {ln.what: ln.bytes for ln in p32.lines}
    assert lines["frozen weights (float32)"] == pc.frozen * 4
    assert {ln.what: ln.bytes for ln in p16.lines}["frozen weights (bfloat16)"] == pc.frozen * 2
    assert lines["AdamW exp_avg + exp_avg_sq (float32)"] == pc.trainable * 8
    assert lines["target logits (float32)"] == cfg.train.window * 129_280 * 4
    # float32 frozen weights under bf16 autocast: a bf16 copy of every expert and the frozen head per step
    assert lines["autocast bfloat16 copies of frozen float32 weights, kept for backward"] == pytest.approx(
        cfg.train.k_steps * (pc.routed_experts + 129_280 * 7168) * 2, rel=1e-6)
    assert p32.total == sum(lines.values())
    # against the H200 measurements (DESIGN.md; K = 2, window 1024): 106.8 GiB float32, 33.6 GiB bf16 frozen —
    # the plan is an upper bound within 15 %
    assert 106.8 <= p32.total / GiB <= 106.8 * 1.15
    assert 33.6 <= p16.total / GiB <= 33.6 * 1.15
    assert not p32.fits_one_gpu and p16.fits_one_gpu  # on an 80 GiB GPU


def test_a_micro_batch_runs_as_one_batch_in_the_plan(v3_plan):
    """micro_batch B: the activations and every loss term of B windows at once (they run as one batch); the
    weights, optimizer state and attention masks do not grow."""
    cfg, plans = v3_plan
    tc = memory.shipped_target_config(cfg.prepare_target.hub_id)
    one = {ln.what: ln for ln in plans["bfloat16"].lines}
    four = memory.plan_for_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": 4})}),
                                  tc, frozen_dtype="bfloat16")
    lines = {ln.what: ln for ln in four.lines}
    assert cfg.train.micro_batch == 1 and four.loss_rows == 4 * cfg.train.window
    for what in ("target logits (float32)", "loss state kept for backward",
                 "loss working set (draft logits; backward gradient + cast)"):
        assert lines[what].bytes == 4 * one[what].bytes, what
    assert 3.9 * one["activations"].bytes < lines["activations"].bytes < 4 * one["activations"].bytes  # masks once
    assert lines["frozen weights (bfloat16)"].bytes == one["frozen weights (bfloat16)"].bytes
    assert any("micro_batch 4: its windows run as one batch" in a for a in four.assumptions)


def test_v41_dspark_counted_from_the_layout():
    cfg = load_config(V41)
    tc = memory.shipped_target_config(cfg.prepare_target.hub_id)
    plan = memory.plan_for_config(cfg, tc, frozen_dtype="bfloat16", gpu_memory=141 * GiB)
    pc = plan.drafter.params
    shapes = memory.dspark_v41_tensors(tc.config, 3, 3)
    from drafter.models.dspark_v41 import describe

    assert describe(shapes).stages == 3
    assert shapes["mtp.0.main_proj.weight"] == (5120, 3 * 5120)
    assert shapes["mtp.2.markov_head.embed.weight"] == (129_280, 256)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 5120 + 256)
    assert pc.routed_experts == 3 * 384 * 3 * 2304 * 5120
    assert pc.trainable == sum(int(__import__("math").prod(s)) for k, s in shapes.items() if ".ffn.experts." not in k)
    assert plan.fits_one_gpu


def test_parse_size():
    assert memory.parse_size("80GiB") == 80 * GiB
    assert memory.parse_size("141 GiB") == 141 * GiB
    assert memory.parse_size("80GB") == 80 * 10 ** 9
    with pytest.raises(ValueError):
        memory.parse_size("lots")


@pytest.mark.parametrize("config, expect", [
    (V3, ["13,463,426,048 (13.46 B) total", "11,274,289,152 (11.27 B) routed experts", "335,778,816 (336 M)",
          "configs/targets/deepseek-v3-0324.config.json", "fits one 141 GiB GPU"]),
    (V41, ["DeepSeek-V4.1 DSpark drafter, 3 stages", "configs/targets/deepseek-v4.1-flash.config.json",
           "dspark_n_routed_experts"]),
])
def test_drafter_plan_prints_stages_and_memory_offline(config, expect, tmp_path, monkeypatch):
    """Without weights, without network: the stage plan (a local --store) and the memory plan."""
    from drafter.cli import app

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(app, ["plan", "-c", str(config), "--store", str(tmp_path / "store"), "--gpu-memory", "141GiB"])
    assert r.exit_code == 0, r.output
    assert "train" in r.output and "to compute" in r.output
    assert "memory plan:" in r.output and "total" in r.output and "assumptions:" in r.output
    for e in expect:
        assert e in r.output, e


def test_drafter_plan_bad_gpu_memory(tmp_path):
    from drafter.cli import app

    r = CliRunner().invoke(app, ["plan", "-c", str(V3), "--store", str(tmp_path), "--gpu-memory", "lots"])
    assert r.exit_code == 2 and "--gpu-memory" in r.output
