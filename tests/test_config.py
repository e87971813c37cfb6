from pathlib import Path

import pytest
import yaml

from drafter.core.config import ReleaseConfig, load_config
from drafter.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_demo_config_loads_with_profiles():
    cfg = load_config(ROOT / "configs/demo.yaml")
    quick = load_config(ROOT / "configs/demo.yaml", profile="quick")
    assert cfg.prepare_target.source == "embedded"
    assert quick.generate.num_prompts < cfg.generate.num_prompts


def test_demo_profiles_full_and_default_sizes():
    """The default demo is the 30-minute size; `full` is the old default (and shares its data stages with
    the DSpark demo); the default's A/B is compiled at T=0 and T=1 with the released drafter at T=0 only."""
    from drafter.core.pipeline import plan

    def stage_key_of(c, stage):
        return {p.stage.name: p.key for p in plan(c, only=[stage])}[stage]

    cfg = load_config(ROOT / "configs/demo.yaml")
    full = load_config(ROOT / "configs/demo.yaml", profile="full")
    dspark = load_config(ROOT / "configs/demo-dspark.yaml")
    assert cfg.generate.num_prompts < full.generate.num_prompts and cfg.train.max_steps < full.train.max_steps
    assert cfg.ablation.losses == [] and full.ablation.losses == ["kl"]
    assert cfg.ab_live.compiled is True and cfg.ab_live.temperature == [0.0, 1.0] and cfg.ab_live.baseline_at == "gate"
    assert full.ab_live.baseline_at == "all" and full.ab_live.rounds == 2 and full.ab_live.compiled is True
    # the default trains in bfloat16 autocast where the CPU has bf16 matmuls (bench/train.py: 1.5x the float32 step
    # with AMX), else float32 (AVX2 emulates bf16: 19x slower per step), full in float32
    assert cfg.train.dtype == "auto" and cfg.bootstrap_drafter.dtype == "float32"
    assert full.train.dtype == full.bootstrap_drafter.dtype == "float32" and full.train.k_steps == 4
    assert (cfg.verify_fp8.vllm_load, full.verify_fp8.vllm_load) == (False, True)
    assert cfg.ab_live.max_tokens == full.ab_live.max_tokens == full.generate.max_tokens == 128
    assert (cfg.ab_live.num_turns, full.ab_live.num_turns) == (8, 16)
    for stage in ("prepare_target", "generate", "scrub"):
        assert stage_key_of(full, stage) == stage_key_of(dspark, stage), stage
        assert stage_key_of(cfg, stage) != stage_key_of(dspark, stage) or stage == "prepare_target", stage


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"generate\.temprature"):
        load_config(write(tmp_path, {"generate": {"temprature": 0.5}}))


def test_bad_value_is_named_with_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"generate": {"top_p": 1.5}}))
    assert "generate.top_p" in str(e.value) and "1.5" in str(e.value)


def test_hub_source_needs_revision(tmp_path):
    with pytest.raises(ConfigError, match="revision"):
        load_config(write(tmp_path, {"prepare_target": {"source": "hub", "hub_id": "org/model"}}))


def test_bad_scrub_regex_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"scrub\.extra_patterns.*'bad'"):
        load_config(write(tmp_path, {"scrub": {"extra_patterns": {"bad": "(unclosed"}}}))


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(write(tmp_path, {}), overrides=["generate.num_prompts=7", "capture.layers=[1, 2]",
                                                      "serving.enforce_eager=false"])
    assert cfg.generate.num_prompts == 7 and cfg.capture.layers == [1, 2] and cfg.serving.enforce_eager is False


def test_override_errors(tmp_path):
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(write(tmp_path, {}), overrides=["generate.num_prompts"])
    with pytest.raises(ConfigError, match="generate.num_prompts"):
        load_config(write(tmp_path, {}), overrides=["generate.num_prompts=many"])


def test_missing_file_and_profile(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no profile 'fast'.*quick"):
        load_config(ROOT / "configs/demo.yaml", profile="fast")


def test_every_field_has_a_description():
    """The Prefect UI renders the config as a form: every field needs a description."""
    def walk(model, prefix=""):
        for name, f in model.model_fields.items():
            assert f.description, f"{prefix}{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, ReleaseConfig.__mro__[1]):
                walk(ann, f"{prefix}{name}.")
    walk(ReleaseConfig)
    schema = ReleaseConfig.model_json_schema()
    assert "generate" in schema["properties"]


def test_ab_live_server_args_are_checked_and_key_only_the_ab(tmp_path):
    from drafter.core.stage import stage_key
    from drafter.stages import ab_live, generate

    with pytest.raises(ConfigError, match=r"ab_live\.server_args.*--speculative-config"):
        load_config(write(tmp_path, {"ab_live": {"server_args": ["--speculative-config", "{}"]}}))
    with pytest.raises(ConfigError, match=r"ab_live\.server_args.*--port=8000"):
        load_config(write(tmp_path, {"ab_live": {"server_args": ["--port=8000"]}}))
    a = load_config(write(tmp_path, {}))
    b = load_config(write(tmp_path, {}), overrides=['ab_live.server_args=["--block-size", "32"]'])
    assert b.ab_live.server_args == ["--block-size", "32"]
    keys = {"prepare_target": "p", "generate": "g", "bootstrap_drafter": "b", "train": "t"}
    # a server setting of the A/B re-measures the A/B, but does not regenerate the data
    assert stage_key(generate.STAGE, a, keys) == stage_key(generate.STAGE, b, keys)
    assert stage_key(ab_live.STAGE, a, keys) != stage_key(ab_live.STAGE, b, keys)


def test_ab_live_temperature_is_a_sorted_list_and_bad_values_are_named(tmp_path):
    assert load_config(write(tmp_path, {})).ab_live.temperature == [0.0]
    assert load_config(write(tmp_path, {"ab_live": {"temperature": 0.7}})).ab_live.temperature == [0.7]
    assert load_config(write(tmp_path, {}), overrides=["ab_live.temperature=1"]).ab_live.temperature == [1.0]
    cfg = load_config(write(tmp_path, {"ab_live": {"temperature": [1, 0, 1.0, 0.5]}}))
    assert cfg.ab_live.temperature == [0.0, 0.5, 1.0]
    with pytest.raises(ConfigError, match=r"ab_live\.temperature: .*every temperature must be a finite number ≥ 0, "
                                          r"got \[-0\.5\] in \[0\.0, -0\.5\]"):
        load_config(write(tmp_path, {"ab_live": {"temperature": [0, -0.5]}}))
    with pytest.raises(ConfigError, match=r"ab_live\.temperature: .*got \[-1\.0\].*\(got -1\)"):
        load_config(write(tmp_path, {"ab_live": {"temperature": -1}}))
    with pytest.raises(ConfigError, match=r"ab_live\.temperature: .*at least 1 item"):
        load_config(write(tmp_path, {"ab_live": {"temperature": []}}))
    with pytest.raises(ConfigError, match=r"ab_live\.temperature\.1: .*valid number.*\(got 'hot'\)"):
        load_config(write(tmp_path, {"ab_live": {"temperature": [0, "hot"]}}))
    with pytest.raises(ConfigError, match=r"ab_live\.temperature: .*finite"):
        load_config(write(tmp_path, {}), overrides=["ab_live.temperature=[0, .inf]"])
    with pytest.raises(ConfigError, match=r"ab_live\.draft_sample_methods: .*at least 1 item"):
        load_config(write(tmp_path, {"ab_live": {"draft_sample_methods": []}}))
    assert load_config(write(tmp_path, {})).ab_live.draft_sample_methods == ["greedy", "probabilistic"]
    # the JSON schema (what a Prefect server checks a run's parameters against) takes one number or a list
    import jsonschema

    schema = ReleaseConfig.model_json_schema()
    for ok in (0.7, [0, 1]):
        jsonschema.validate({"ab_live": {"temperature": ok}}, schema)
    for bad in (-1, [], [0, -1], "hot"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"ab_live": {"temperature": bad}}, schema)


def test_ab_live_compiled_follows_serving_unless_set_and_keys_only_the_ab(tmp_path):
    from drafter.core.stage import stage_key
    from drafter.stages import ab_live, generate

    a = load_config(write(tmp_path, {}))
    assert a.ab_live.compiled is None and a.ab_live.eager(a.serving) is True  # serving.enforce_eager: true
    b = load_config(write(tmp_path, {}), overrides=["ab_live.compiled=true"])
    assert b.ab_live.eager(b.serving) is False and b.serving.enforce_eager is True
    c = load_config(write(tmp_path, {}), overrides=["serving.enforce_eager=false"])
    assert c.ab_live.eager(c.serving) is False
    keys = {"prepare_target": "p", "generate": "g", "bootstrap_drafter": "b", "train": "t"}
    # compiled A/B servers re-measure the A/B, but do not regenerate the data (serving.enforce_eager would)
    assert stage_key(generate.STAGE, a, keys) == stage_key(generate.STAGE, b, keys) != stage_key(generate.STAGE, c, keys)
    assert stage_key(ab_live.STAGE, a, keys) != stage_key(ab_live.STAGE, b, keys)
    with pytest.raises(ConfigError, match=r"ab_live\.compiled"):
        load_config(write(tmp_path, {"ab_live": {"compiled": "sometimes"}}))


@pytest.mark.parametrize("name", ["deepseek-v3-mtp.yaml", "deepseek-v4.1-flash-dspark.yaml"])
def test_seed_configs_load_and_validate(name):
    """The two seed releases' configs: every key validates; GPU settings (torchrun on 8 GPUs, CUDA devices,
    vLLM tensor parallel, an s3:// store) and the recipe's fields as the releases train them."""
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.prepare_target.source == "hub" and cfg.prepare_target.revision
    assert cfg.store.root.startswith("s3://")
    assert (cfg.train.nproc_per_node, cfg.train.device, cfg.capture.device) == (8, "cuda", "cuda")
    assert "--tensor-parallel-size" in cfg.serving.extra_args and cfg.train.dtype == "bfloat16"
    if name.startswith("deepseek-v3"):
        assert cfg.prepare_target.hub_id == "deepseek-ai/DeepSeek-V3-0324"
        assert (cfg.train.loss, cfg.train.eta, cfg.eval_offline.k_max) == ("lk_hybrid", 3.0, 7)
        assert (cfg.quantize_fp8.scale, cfg.quantize_fp8.block) == ("float32", [128, 128])
        assert cfg.train.freeze == ReleaseConfig().train.freeze  # the default: experts, embedding, head frozen
    else:
        assert cfg.dspark.enabled and (cfg.dspark.num_hidden_layers, cfg.dspark.block_size) == (3, 5)
        assert (cfg.dspark.markov_rank, cfg.dspark.confidence_head) == (256, True)
        assert (cfg.train.loss, cfg.train.ce_w, cfg.train.l1_w, cfg.train.gamma) == ("ce_l1", 0.1, 0.9, 4.0)
        assert (cfg.quantize_fp8.scale, cfg.quantize_fp8.block) == ("ue8m0", [32, 32])
        assert (cfg.quantize_exl3.bits, cfg.quantize_exl3.overrides) == (5.0, {"main_proj": 6.0})
        assert cfg.ab_live.num_speculative_tokens == cfg.dspark.block_size


def test_ab_live_sweep_settings_default_and_bad_values_are_named(tmp_path):
    a = load_config(write(tmp_path, {})).ab_live
    assert a.concurrency == [1, 2, 4, 8] and a.ks() == [1, 2, 3] and a.schedule is True
    assert a.concurrency_at(0.0) == [1, 2, 4, 8]
    b = load_config(write(tmp_path, {"ab_live": {"num_speculative_tokens": 4, "k_sweep": [3, 1, 3],
                                                 "temperature": [0, 1], "concurrency_other_temperatures": [8, 1]}})).ab_live
    assert b.k_sweep == [1, 3] and b.ks() == [1, 3, 4]  # the served K is always measured
    assert b.concurrency_at(0.0) == [1, 2, 4, 8] and b.concurrency_at(1.0) == [1, 8]
    with pytest.raises(ConfigError, match=r"ab_live\.k_sweep.*every K must be 1\.\.16.*\[0, 2\]"):
        load_config(write(tmp_path, {"ab_live": {"k_sweep": [0, 2]}}))
    with pytest.raises(ConfigError, match=r"concurrency_other_temperatures \[16\] must name some of concurrency"):
        load_config(write(tmp_path, {"ab_live": {"concurrency_other_temperatures": [16]}}))


def test_eagle3_section_validates_and_keys_nothing_while_disabled(tmp_path):
    """A disabled eagle3 section (and the defaults of train.init / prepare_target.architecture) enter no stage key,
    so stores made before them keep their keys; enabled, it keys the drafter stages; bad combinations are named."""
    from drafter.core.stage import key_config, stage_key
    from drafter.stages import bootstrap_drafter, eval_offline, prepare_target, train

    plain = load_config(write(tmp_path, {}))
    explicit = load_config(write(tmp_path, {"prepare_target": {"architecture": "glm4_moe_mtp"}, "train": {"init": None}}))
    keys = {"prepare_target": "p", "capture": "c", "scrub": "s", "bootstrap_drafter": "b", "train": "t"}
    for st in (prepare_target.STAGE, bootstrap_drafter.STAGE, train.STAGE, eval_offline.STAGE):
        assert "eagle3" not in key_config(st, plain)
        assert stage_key(st, plain, keys) == stage_key(st, explicit, keys)
    on = load_config(ROOT / "configs" / "demo-eagle3.yaml")
    assert on.eagle3.enabled and on.eagle3.aux_layer_ids == [2, 15, 27] and on.prepare_target.architecture == "llama"
    assert key_config(train.STAGE, on)["eagle3"]["draft_vocab_size"] == 8192
    assert stage_key(prepare_target.STAGE, on, {}) != stage_key(prepare_target.STAGE, plain, {})
    bad = {
        r"eagle3\.enabled and dspark\.enabled": {"eagle3": {"enabled": True}, "dspark": {"enabled": True,
                                                                                      "target_layer_ids": [1]},
                                                "capture": {"layers": [2]}},
        r"capture\.layers \[2\] lacks \[5\]: eagle3\.aux_layer_ids \[2, 5\]": {
            "eagle3": {"enabled": True, "aux_layer_ids": [2, 5]}, "capture": {"layers": [2]},
            "ab_live": {"method": "eagle3"}},
        r"train\.init is for EAGLE-3 heads": {"train": {"init": "/some/head"}},
        r"ab_live\.method is 'mtp'; set ab_live\.method: eagle3": {"eagle3": {"enabled": True}},
        r"train\.draft_vocab_size 64: an EAGLE-3 head has its own": {"eagle3": {"enabled": True},
                                                                     "ab_live": {"method": "eagle3"},
                                                                     "train": {"draft_vocab_size": 64}},
        r"eagle3\.aux_layer_ids \[5, 2\]": {"eagle3": {"aux_layer_ids": [5, 2]}},
    }
    for pattern, doc in bad.items():
        with pytest.raises(ConfigError, match=pattern):
            load_config(write(tmp_path, doc))
