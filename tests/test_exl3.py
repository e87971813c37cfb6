"""EXL3 form: tested up to exllamav3's boundary (it needs CUDA to convert).

Covers the one-layer presentation of the MTP layer, bits/override resolution, the converter's
command line, the CUDA probe (→ a skipped stage with the probe's reason on this CPU machine, through
the real stage runner), the converter runner's log handling, and the validation of an output
directory built here in exllamav3's real on-disk format (good and broken)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError
from drafter.models import TRAINED_NAME, layout_for, load_drafter, save_drafter
from drafter.quant import exl3
from drafter.stages.quantize_exl3 import drafter_presentation

Q = "model.layers.0."


@pytest.fixture(scope="module")
def presented(tiny_target):
    layout, pres = drafter_presentation(tiny_target)
    return layout, pres


def test_presentation_maps_the_mtp_layer_to_a_one_layer_model(tiny_target, presented):
    _, pres = presented
    cfg = json.loads((tiny_target / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    assert pres.arch == "Glm4MoeForCausalLM" and pres.mtp_index == L == 2
    assert pres.names["lm_head.weight"] == f"model.layers.{L}.shared_head.head.weight"
    assert pres.names["model.norm.weight"] == f"model.layers.{L}.shared_head.norm.weight"
    assert pres.names["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert pres.names[Q + "self_attn.q_proj.weight"] == f"model.layers.{L}.self_attn.q_proj.weight"
    assert sorted(pres.not_converted) == [f"model.layers.{L}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm")]
    assert all("no slot for" in r for r in pres.not_converted.values())
    # the linears exllamav3 quantizes in a Glm4Moe block: 4 attention + 2 experts × 3 + shared × 3
    assert len(pres.quantized) == 13
    assert Q + "mlp.gate" not in pres.quantized and Q + "self_attn.o_proj" in pres.quantized
    c = pres.config
    assert (c["num_hidden_layers"], c["first_k_dense_replace"], c["num_nextn_predict_layers"]) == (1, 0, 0)
    assert c["architectures"] == ["Glm4MoeForCausalLM"] and c["tie_word_embeddings"] is False
    assert c["hidden_size"] == cfg["hidden_size"] and "quantization_config" not in c


def test_presentation_refuses_other_architectures(presented):
    _, pres = presented
    shapes = {rel: pres.shapes[n] for n, rel in pres.names.items()}
    with pytest.raises(StageError, match=r"Qwen3ForCausalLM.*supports"):
        exl3.plan_presentation({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}, shapes)
    no_head = {k: v for k, v in shapes.items() if "shared_head.head" not in k}
    with pytest.raises(StageError, match="lm_head.weight"):
        exl3.plan_presentation({"architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 2}, no_head)


def test_input_dir_holds_the_fine_tuned_tensors_in_bf16(tiny_target, presented, tmp_path):
    layout, pres = presented
    drafter = load_drafter(tiny_target, layout)
    with torch.no_grad():
        drafter.layers[0].eh_proj.weight.mul_(0.5)
        drafter.layers[0].mtp_block.self_attn.o_proj.weight.add_(0.25)
    tensors = layout.to_release(drafter)
    d = exl3.write_input_dir(pres, tensors, tiny_target, tmp_path / "in")
    written = load_file(str(d / "model.safetensors"))
    assert set(written) == set(pres.names)
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    o = written[Q + "self_attn.o_proj.weight"]
    assert torch.equal(o, tensors["model.layers.2.self_attn.o_proj.weight"].bfloat16())
    assert not any("eh_proj" in k or "enorm" in k for k in written)
    assert json.loads((d / "config.json").read_text()) == pres.config
    assert (d / "tokenizer.json").read_bytes() == (tiny_target / "tokenizer.json").read_bytes()

    bad = dict(tensors)
    bad["model.layers.2.self_attn.k_proj.weight"] = torch.full_like(bad["model.layers.2.self_attn.k_proj.weight"], float("nan"))
    with pytest.raises(StageError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight has NaN"):
        exl3.write_input_dir(pres, bad, tiny_target, tmp_path / "in2")


def test_bits_plan_applies_overrides_and_reports_what_it_cannot(presented):
    _, pres = presented
    plan = exl3.plan_bits(pres, 5.0, 6, {"eh_proj": 6.0, "*self_attn.o_proj*": 6, "shared_head.head": 8})
    assert plan.per_tensor == {Q + "self_attn.o_proj": 6.0}
    assert plan.head_bits == 8.0
    assert plan.overrides["eh_proj"]["applied_to"] == []
    assert "no slot for eh_proj" in plan.overrides["eh_proj"]["not_applied"]["model.layers.2.eh_proj.weight"]
    assert plan.overrides["*self_attn.o_proj*"]["applied_to"] == ["model.layers.2.self_attn.o_proj.weight"]
    assert plan.recipe == {"target_bpw": 5.0, "head_bits": 8, "tensors": {"*": 5, Q + "self_attn.o_proj": 6}}
    # an override on the router (kept unquantized by exllamav3) is reported, not silently dropped
    router = exl3.plan_bits(pres, 5.0, 6, {"mlp.gate.weight": 4})
    assert router.recipe is None and router.overrides["mlp.gate.weight"]["not_applied"]
    # only eh_proj overridden: no recipe, plain --bits
    assert exl3.plan_bits(pres, 4.25, 6, {"eh_proj": 6}).recipe is None


@pytest.mark.parametrize("bits,head,overrides,match", [
    (5.0, 6, {"eh_prj": 6}, r"overrides\['eh_prj'\] matches no drafter tensor"),
    (5.0, 6, {"o_proj": 4.5}, r"overrides\['o_proj'\]=4.5: not a rate"),
    (4.25, 6, {"o_proj": 6}, r"bits=4.25 with per-tensor overrides"),
    (9.0, 6, {}, r"bits=9.0"),
])
def test_bits_plan_rejects_bad_settings(presented, bits, head, overrides, match):
    _, pres = presented
    with pytest.raises(StageError, match=match):
        exl3.plan_bits(pres, bits, head, overrides)


def test_config_section_rejects_rates_exllamav3_lacks():
    from drafter.core.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"quantize_exl3\.overrides"):
        config_from_dict({"quantize_exl3": {"overrides": {"eh_proj": 5.5}}})
    assert config_from_dict({"quantize_exl3": {"overrides": {"eh_proj": 2.5, "o_proj": 16}}}).quantize_exl3.overrides


def test_converter_command_from_config(tmp_path):
    cmd = exl3.converter_command("/cuda/bin/python", tmp_path / "in", tmp_path / "out", tmp_path / "w", bits=5.0,
                                 head_bits=6.0, codebook="mcg", cal_rows=32, cal_cols=512, extra_args=["-d", "0,1"])
    assert cmd == ["/cuda/bin/python", "-m", "exllamav3.conversion.convert_model", "-w", str(tmp_path / "w"),
                   "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "-b", "5", "-hb", "6", "-cb", "mcg",
                   "-cr", "32", "-cc", "512", "-d", "0,1"]
    with_recipe = exl3.converter_command("py", tmp_path, tmp_path, tmp_path / "w", bits=4.5, head_bits=6,
                                         recipe=tmp_path / "r.yaml")
    assert with_recipe[with_recipe.index("-b") + 1] == "4.5" and with_recipe[-2:] == ["-rcp", str(tmp_path / "r.yaml")]
    assert exl3.converter_command("py", tmp_path, tmp_path, tmp_path / "w", bits=5, head_bits=6, resume=True) == [
        "py", "-m", "exllamav3.conversion.convert_model", "-w", str(tmp_path / "w"), "-r"]


def test_probe_findings():
    assert exl3.probe_finding({"python": "p", "torch_error": "ModuleNotFoundError: torch"}).startswith(
        "needs CUDA: p cannot import torch")
    assert "a CUDA 12.8 build) sees no CUDA device" in exl3.probe_finding(
        {"python": "p", "torch": "2.9", "torch_cuda": "12.8", "cuda": False})
    assert "no CUDA toolkit" in exl3.probe_finding({"python": "p", "cuda": True, "devices": ["H200"], "cuda_home": None})
    assert exl3.probe_finding({"python": "p", "cuda": True, "devices": ["H200"], "cuda_home": "/usr/local/cuda",
                               "exllamav3": None}).startswith("needs exllamav3: p has CUDA (H200)")
    assert exl3.probe_finding({"python": "p", "cuda": True, "devices": ["H200"], "cuda_home": "/usr/local/cuda",
                               "exllamav3": "1.6.5"}) is None


def _this_machine_cannot_convert() -> str:
    """The start of the probe's finding for this python: no CUDA device (CI, the CPU machines) — or, on a GPU
    machine, CUDA without a toolkit or without exllamav3 (the GPU check's image has neither)."""
    if not torch.cuda.is_available():
        return f"needs CUDA: torch {torch.__version__} in {sys.executable}"
    import importlib.util

    from torch.utils import cpp_extension

    if not cpp_extension.CUDA_HOME:
        return f"needs CUDA: {sys.executable} has CUDA devices"
    if importlib.util.find_spec("exllamav3") is None:
        return f"needs exllamav3: {sys.executable} has CUDA"
    pytest.skip("this machine has CUDA, a toolkit and exllamav3: it can convert (bench/exl3_gpu.sh measures it)")


def test_probe_of_this_machine():
    p = exl3.probe_python(sys.executable)
    assert p.info["torch"] == torch.__version__ and p.info["cuda"] is torch.cuda.is_available() and not p.ok
    assert p.missing.startswith(_this_machine_cannot_convert())
    # this interpreter answers in-process (no CUDA device here): the same finding as a probe process of it
    other = exl3.probe_python(str(Path(sys.executable).parent / "python3"))
    assert other.python != p.python and other.missing == p.missing.replace(p.python, other.python)
    assert {k: v for k, v in other.info.items() if k not in ("python", "cuda_home")} == \
        {k: v for k, v in p.info.items() if k not in ("python", "cuda_home")}
    gone = exl3.probe_python("/nonexistent/bin/python")
    assert gone.missing == "needs CUDA: the configured python /nonexistent/bin/python does not exist"


# ----------------------------------------------------------------------- the stage, via the runner


def _seeded_store(tiny_target, tmp_path, **exl3_cfg):
    from drafter.core.pipeline import open_store, plan, run_stage

    cfg = ReleaseConfig(store={"root": str(tmp_path / "store")},
                        prepare_target={"source": "path", "path": str(tiny_target)}, quantize_exl3=exl3_cfg)
    store = open_store(cfg)
    assert run_stage(cfg, "prepare_target", store).status == "computed"
    train_key = next(p.key for p in plan(cfg, only=["quantize_exl3"]) if p.stage.name == "train")

    def write_trained(out: Path):  # the train stage's output format: the drafter under release names
        layout = layout_for(tiny_target)
        save_drafter(load_drafter(tiny_target, layout), out / TRAINED_NAME, layout, torch.float32)
        return {}

    store.produce("train", train_key, write_trained, {})
    return cfg, store


def test_stage_is_skipped_on_cpu_with_the_probe_finding(tiny_target, tmp_path):
    from drafter.core.pipeline import run_stage

    cfg, store = _seeded_store(tiny_target, tmp_path)
    r = run_stage(cfg, "quantize_exl3", store)
    assert r.status == "skipped"
    assert r.reason.startswith(_this_machine_cannot_convert())
    out = Path(r.path)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"], "a skipped stage writes no file"
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "skipped" and man["reason"] == r.reason and man["files"] == {}
    again = run_stage(cfg, "quantize_exl3", store)
    assert again.status == "reused" and again.key == r.key

    off = cfg.model_copy(update={"quantize_exl3": cfg.quantize_exl3.model_copy(update={"enabled": False})})
    r_off = run_stage(off, "quantize_exl3", store)
    assert r_off.status == "skipped" and r_off.reason == "disabled: quantize_exl3.enabled is false" and r_off.key != r.key

    other = cfg.model_copy(update={"quantize_exl3": cfg.quantize_exl3.model_copy(update={"python": "/nope/python"})})
    r_other = run_stage(other, "quantize_exl3", store)
    assert r_other.status == "skipped" and "/nope/python does not exist" in r_other.reason


def test_stage_fails_on_a_bad_override_even_without_cuda(tiny_target, tmp_path):
    from drafter.core.pipeline import run_stage

    cfg, store = _seeded_store(tiny_target, tmp_path, overrides={"eh_projj": 6})
    with pytest.raises(StageError, match=r"overrides\['eh_projj'\] matches no drafter tensor"):
        run_stage(cfg, "quantize_exl3", store)


# ------------------------------------------------------------------------------- the converter run


def _fake_converter(tmp_path, body: str) -> list[str]:
    script = tmp_path / "conv.py"
    script.write_text(body)
    return [sys.executable, str(script)]


def test_run_converter_captures_the_log_and_reports_errors(tmp_path):
    good = _fake_converter(tmp_path, (
        "print(' -- Quantized: model.layers.0.self_attn.q_proj          bpw:  5.00  proxy_err: 0.012345  o.  g_sc: 0.5')\n"
        "print(' -- Quantized: model.layers.0                             bpw:  5.00  rfn: 0.010000  cos: 0.000100')\n"
        "print(' -- Quantized: lm_head                                    bpw:  6.00  proxy_err: (zero)    o.  g_sc: 0.5')\n"))
    log = tmp_path / "convert.log"
    lines = exl3.run_converter(good, log, total=2, timeout_s=60)
    assert exl3.parse_converter_log(lines) == {
        "model.layers.0.self_attn.q_proj": {"bits": 5.0, "proxy_err": 0.012345},
        "lm_head": {"bits": 6.0, "proxy_err": None}}
    assert "proxy_err: 0.012345" in log.read_text()

    # exllamav3 reports bad arguments with ' !! Error:' and exits 0
    bad = _fake_converter(tmp_path, "print(' !! Error: Must specify --work_dir')\n")
    with pytest.raises(StageError, match="Must specify --work_dir"):
        exl3.run_converter(bad, log, total=1, timeout_s=60)
    crash = _fake_converter(tmp_path, "import sys; print('boom'); sys.exit(3)\n")
    with pytest.raises(StageError, match=r"(?s)exit 3.*boom"):
        exl3.run_converter(crash, log, total=1, timeout_s=60)


# ------------------------------------------------------------------------ output-dir validation


def _pad(n: int) -> int:
    return -(-n // 128) * 128


def write_exl3_fixture(d: Path, pres: exl3.Presentation, plan: exl3.BitsPlan, bits_of=None) -> Path:
    """An output directory in exllamav3 1.6.5's format (compile.py / quant_config.py): EXL3 linears as
    ``.trellis`` int16 [in/16, out/16, 16·K] + ``.suh``/``.svh`` FP16 + ``.mul1`` int32 marker, the other
    tensors FP16, config.json with quantization_config, quantization_config.json with tensor_storage."""
    g = torch.Generator().manual_seed(0)
    d.mkdir(parents=True)
    tensors, storage = {}, {}
    linears = dict(pres.quantized) | {pres.head_key: "head"}
    for key in linears:
        out_f, in_f = pres.shapes[key + ".weight"]
        k = plan.head_bits if key == pres.head_key else (bits_of or {}).get(key, plan.per_tensor.get(key, 5.0))
        words = int(16 * k)
        tensors[key + ".trellis"] = torch.randint(-2**15, 2**15, (_pad(in_f) // 16, _pad(out_f) // 16, words),
                                                  generator=g, dtype=torch.int32).to(torch.int16)
        tensors[key + ".suh"] = (torch.randint(0, 2, (_pad(in_f),), generator=g) * 2 - 1).half()
        tensors[key + ".svh"] = (torch.rand(_pad(out_f), generator=g) * 0.01).half()
        tensors[key + ".mul1"] = torch.tensor(0x83DCD12D, dtype=torch.int64).to(torch.int32)
        storage[key] = {"stored_tensors": {}, "quant_format": "exl3", "bits_per_weight": int(k) if k == int(k) else k,
                        "mul1_multiplier": 0x83DCD12D}
    for name, shape in pres.shapes.items():
        if name[: -len(".weight")] not in linears:
            tensors[name] = torch.randn(shape, generator=g).half()
            storage[name[: -len(".weight")]] = {"stored_tensors": {}}
    save_file(tensors, str(d / "model.safetensors"))
    qcfg = {"quant_method": "exl3", "version": "1.6.5", "bits": 5.12, "head_bits": int(plan.head_bits),
            "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": "mul1"}
    (d / "config.json").write_text(json.dumps(pres.config | {"quantization_config": qcfg}))
    (d / "quantization_config.json").write_text(json.dumps(qcfg | {"tensor_storage": storage}))
    return d


def _edit(d: Path, fn):
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def _set_json(path: Path, **kv):
    path.write_text(json.dumps(json.loads(path.read_text()) | kv))


def test_validate_output_accepts_exllamav3s_format(presented, tmp_path):
    _, pres = presented
    plan = exl3.plan_bits(pres, 5.0, 6, {"o_proj": 6})
    d = write_exl3_fixture(tmp_path / "ok", pres, plan)
    res = exl3.validate_output(d, pres, plan)
    assert res["bits"] == 5.12 and res["head_bits"] == 6.0
    assert res["per_tensor_bits"][Q + "self_attn.o_proj"] == 6.0 and res["per_tensor_bits"]["lm_head"] == 6.0
    assert res["per_tensor_bits"][Q + "mlp.experts.1.down_proj"] == 5.0 and len(res["per_tensor_bits"]) == 14
    assert res["size_bytes"] == (d / "model.safetensors").stat().st_size

    report = exl3.error_report(pres, plan, res, {Q + "self_attn.o_proj": {"rel_error": 0.02}}, None,
                               {"lm_head": {"bits": 6.0, "proxy_err": 0.004}}, {"exllamav3": "1.6.5"})
    o = report["tensors"]["model.layers.2.self_attn.o_proj.weight"]
    assert o == {"exl3_name": Q + "self_attn.o_proj", "shape": [64, 64], "bits": 6.0, "rel_error": 0.02}
    head = report["tensors"]["model.layers.2.shared_head.head.weight"]
    assert head["rel_error"] is None and head["converter_proxy_err"] == 0.004
    assert report["mean_rel_error"] == report["max_rel_error"] == 0.02
    assert set(report["not_converted"]) == {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
                                            "model.layers.2.hnorm.weight"}


@pytest.mark.parametrize("breakage,match", [
    (lambda d: _edit(d, lambda t: t.pop(Q + "self_attn.o_proj.svh")),
     r"tensor model\.layers\.0\.self_attn\.o_proj\.svh is missing \(drafter model\.layers\.2\.self_attn\.o_proj\.weight"),
    (lambda d: _edit(d, lambda t: t[Q + "mlp.experts.0.up_proj.suh"].__setitem__(3, float("nan"))),
     r"model\.safetensors: tensor model\.layers\.0\.mlp\.experts\.0\.up_proj\.suh .* has 1 NaN"),
    (lambda d: _edit(d, lambda t: t.__setitem__("model.norm.weight", torch.full((64,), float("inf")).half())),
     r"model\.safetensors: tensor model\.norm\.weight has 64 NaN/inf"),
    (lambda d: _edit(d, lambda t: t.__setitem__(Q + "self_attn.q_proj.trellis", t[Q + "self_attn.q_proj.trellis"][:, :1].contiguous())),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.trellis .* is torch\.int16 \(8, 1, 80\), expected int16 \[8, 8, 16·bits\] for weight \(64, 64\)"),
    (lambda d: _edit(d, lambda t: t.pop(Q + "self_attn.k_proj.mul1")),
     r"tensor model\.layers\.0\.self_attn\.k_proj\.mul1 \(the mul1 codebook marker\) is missing"),
    (lambda d: _set_json(d / "config.json", quantization_config={"quant_method": "gptq"}),
     r"config\.json: quantization_config\.quant_method is 'gptq', expected 'exl3'"),
    (lambda d: (d / "quantization_config.json").unlink(), r"quantization_config\.json is missing"),
])
def test_validate_output_names_what_is_broken(presented, tmp_path, breakage, match):
    _, pres = presented
    plan = exl3.plan_bits(pres, 5.0, 6, {"o_proj": 6})
    d = write_exl3_fixture(tmp_path / "broken", pres, plan)
    breakage(d)
    with pytest.raises(StageError, match=match):
        exl3.validate_output(d, pres, plan)


def test_validate_output_checks_the_overridden_bits(presented, tmp_path):
    _, pres = presented
    plan = exl3.plan_bits(pres, 5.0, 6, {"o_proj": 6})
    d = write_exl3_fixture(tmp_path / "wrong-bits", pres, plan, bits_of={Q + "self_attn.o_proj": 5.0})
    with pytest.raises(StageError, match=r"o_proj\.trellis .*: 5 bits, but the plan gives 6"):
        exl3.validate_output(d, pres, plan)


def test_relative_error():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert exl3.relative_error(w, w) == 0.0
    assert exl3.relative_error(w, w * 1.01) == pytest.approx(0.01, rel=1e-5)
