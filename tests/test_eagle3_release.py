"""An EAGLE-3 release after the live A/B: quantize_fp8 / verify_fp8 / quantize_exl3 skip an EAGLE-3 head with their
reasons; the card (model_card_templates/eagle3.md) renders from the release's stage outputs — the eagle3 usage line
with the release repo as ``model`` and the A/B's K (or schedule), the head's aux layers and draft vocabulary, every
number equal to its stage file — and the release folder is the head vLLM loads from the repo root.

The stage outputs are small but real: both heads are written by drafter.models.eagle3 on a tiny config, the
quantize and gate stages run for real on them; the training, offline and live numbers are documents in the
schemas those stages write (tests/test_gate.py, tests/test_card_speed.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageSkipped
from drafter.core.files import write_json_atomic
from drafter.core.stage import Artifact, key_config
from drafter.models.eagle3 import EAGLE3_DIR, Eagle3Config, Eagle3Draft, load_eagle3, save_eagle3
from drafter.release.card import card_context, render_card
from drafter.release.folder import build_release_folder
from drafter.stages import gate as gate_stage
from drafter.stages import quantize_exl3, quantize_fp8, verify_fp8
from tests.test_card import section, table
from tests.test_card_speed import PAYS, SWEEP_PAYS, ab_with_schedule
from tests.test_gate import eval_offline

AUX, V, VD, H = [1, 2, 3], 96, 40, 32
HEAD_K = 3  # eagle3.speculative_tokens: written into the heads' speculators config
REPO, TARGET = "org/tiny-eagle3", "org/tiny-llama"


def _config(**over) -> ReleaseConfig:
    data = {"name": "tiny-eagle3", "prepare_target": {"source": "hub", "hub_id": TARGET, "revision": "abc123"},
            "capture": {"layers": AUX},
            "eagle3": {"enabled": True, "aux_layer_ids": AUX, "draft_vocab_size": VD, "speculative_tokens": HEAD_K},
            "train": {"loss": "lk_hybrid", "k_steps": HEAD_K, "freeze": ["embed_tokens.*"]},
            "ab_live": {"method": "eagle3", "num_speculative_tokens": 4},
            "quantize_exl3": {"enabled": True}, "gate": {"force": True},
            "publish": {"tags": ["tiny-test"], "datasets": []}} | over
    return ReleaseConfig.model_validate(data)


def write_head(folder: Path, seed: int, layout: str = "speculators") -> Eagle3Draft:
    """A tiny EAGLE-3 head (draft vocabulary: every other target id below 2·VD) written as vLLM loads it."""
    torch.manual_seed(seed)
    head = Eagle3Draft(Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=16, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H,
                                    aux_layer_ids=AUX))
    head.set_draft_vocab(range(0, 2 * VD, 2))
    save_eagle3(head, folder, layout=layout, verifier=TARGET, verifier_architectures=["LlamaForCausalLM"],
                speculative_tokens=HEAD_K)
    return head


def _target(root: Path) -> Artifact:
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                            "hidden_size": H, "vocab_size": V, "num_hidden_layers": 4}))
    (root / "target.json").write_text(json.dumps({"model_dir": "model", "source": "hub", "name": TARGET,
                                                  "revision": "abc123", "chat_template_sha256": "0" * 64}))
    return Artifact("prepare_target", "p" * 16, root, {"status": "done"})


def _train(root: Path, head: Eagle3Draft) -> Artifact:
    """The train output: the fine-tuned head and its result.json (the schema training writes)."""
    def check(tau: float) -> dict:
        return {"t0": {"tau": tau, "alpha": [0.5, 0.3, 0.2]}, "t1_greedy": {"tau": tau - 0.1, "alpha": [0.45, 0.25, 0.15]}}

    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    write_json_atomic(root / "result.json", {
        "baseline": check(1.6), "final": check(1.8), "trainable": trainable, "frozen": V * H, "seconds": 12.0,
        "tokens": 4096, "tokens_per_s": 341.3, "layout": "eagle3", "loss": "lk_hybrid", "k_steps": HEAD_K,
        "train_windows": 16, "eval_windows": 4, "device": "cpu",
        "draft_vocab": {"size": VD, "vocab_size": V, "file": None, "trained_over": True, "aux_layer_ids": AUX}})
    return Artifact("train", "t" * 16, root, {"status": "done"})


def _skipped(stage, cfg, inputs: dict, out: Path) -> Artifact:
    """Run ``stage`` for real; it must skip: its output as the store records a skip."""
    out.mkdir(parents=True)
    with pytest.raises(StageSkipped) as e:
        stage.STAGE.run(cfg, inputs, out)
    return Artifact(stage.STAGE.name, stage.STAGE.name[0] * 16, out, {"status": "skipped", "reason": str(e.value)})


def _ab_live(root: Path, local_head: Path) -> Artifact:
    """ab_live.json of an EAGLE-3 A/B (K=4, T=0 and T=1, the concurrency × K sweep, the served schedule): the
    speculative configs name the local head folder the servers loaded."""
    ab = ab_with_schedule(PAYS, SWEEP_PAYS, served=True, t1={"greedy": {c: (n, n, n * 1.2) for c, (n, _, _) in
                                                                        PAYS.items()}})
    ab["method"] = "eagle3"
    sc = ab["schedule"]["speculative_config"]
    ab["schedule"]["speculative_config"] = {"method": "eagle3", "model": str(local_head),
                                            **{k: v for k, v in sc.items() if k != "method"}}
    for srv in ab["servers"]:
        srv["speculative_config"] |= {"method": "eagle3", "model": str(local_head)}
    ab |= {"replay": {"turns": 16, "conversations": 4, "domains": ["agent"], "max_tokens": 128, "notes": []},
           "server_args": ["--block-size", "32"], "hardware": None}
    write_json_atomic(root / "ab_live.json", ab)
    return Artifact("ab_live", "a" * 16, root, {"status": "done"})


@pytest.fixture(scope="module")
def eagle3_store(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle3-release")
    cfg = _config()
    released = write_head(root / "boot" / EAGLE3_DIR, seed=0)
    tuned = write_head(root / "train" / EAGLE3_DIR, seed=1)
    inputs = {"prepare_target": _target(root / "pt"),
              "bootstrap_drafter": Artifact("bootstrap_drafter", "b" * 16, root / "boot", {"status": "done"}),
              "train": _train(root / "train", tuned)}
    ev = eval_offline() | {"confidence": 0.95, "positions": 100, "conversations": 4, "windows": 8,
                           "bootstrap_samples": 50, "draft_vocab": {"baseline": VD, "candidate": VD}}
    write_json_atomic(root / "ev" / "eval_offline.json", ev)
    inputs["eval_offline"] = Artifact("eval_offline", "e" * 16, root / "ev", {"status": "done"})
    inputs["quantize_fp8"] = _skipped(quantize_fp8, cfg, inputs, root / "q8")
    inputs["verify_fp8"] = _skipped(verify_fp8, cfg, inputs, root / "v8")
    inputs["quantize_exl3"] = _skipped(quantize_exl3, cfg, inputs, root / "x3")
    inputs["ab_live"] = _ab_live(root / "ab", root / "train" / EAGLE3_DIR)
    (root / "gate").mkdir()
    gate_stage.STAGE.run(cfg, inputs, root / "gate")
    inputs["gate"] = Artifact("gate", "g" * 16, root / "gate", {"status": "done"})
    return {"cfg": cfg, "inputs": inputs, "root": root, "released": released, "tuned": tuned}


@pytest.fixture(scope="module")
def release(eagle3_store, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eagle3-folder") / "release"
    res = build_release_folder(eagle3_store["cfg"], eagle3_store["inputs"], out, version="0.1.0",
                               git_commit="0123456789abcdef", repo_id=REPO)
    return {"out": out, "res": res, "md": (out / "README.md").read_text()}


# --------------------------------------------------------------------------- quantized forms


def test_fp8_and_exl3_skip_an_eagle3_head_with_their_reasons(eagle3_store):
    inputs, root = eagle3_store["inputs"], eagle3_store["root"]
    q = inputs["quantize_fp8"].manifest["reason"]
    assert q == (f"the released EAGLE-3 head {root / 'boot' / EAGLE3_DIR} is not FP8: there is no FP8 release to match; "
                 "the fine-tuned head ships in the release's own dtype")
    v = inputs["verify_fp8"].manifest["reason"]
    assert v == f"no FP8 drop-in to verify: quantize_fp8 was skipped ({q})"
    x = inputs["quantize_exl3"].manifest["reason"]
    assert x.startswith("the drafter is an EAGLE-3 head: exllamav3 has no EAGLE-3 head architecture to quantize")
    for name in ("q8", "v8", "x3"):
        assert not any((root / name).iterdir())  # a skip writes nothing
    # the section enters quantize_fp8's key only when enabled (existing keys unchanged)
    assert "eagle3" in key_config(quantize_fp8.STAGE, eagle3_store["cfg"])
    assert "eagle3" not in key_config(quantize_fp8.STAGE, ReleaseConfig())


def test_an_fp8_released_head_is_skipped_as_not_implemented(eagle3_store, tmp_path):
    """train.init pointing at a head with FP8 tensors: no drop-in is made, and the reason says so."""
    head = tmp_path / "fp8-head"
    head.mkdir()
    src = eagle3_store["root"] / "boot" / EAGLE3_DIR
    (head / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(head / "model.safetensors"))
    cfg = _config(train={"loss": "lk_hybrid", "k_steps": HEAD_K, "freeze": ["embed_tokens.*"], "init": str(head)})
    with pytest.raises(StageSkipped, match=re.escape(f"the released EAGLE-3 head {head} has 1 FP8 tensor(s) (e.g. "
                                                     "fc.weight), but an FP8 drop-in of an EAGLE-3 head is not "
                                                     "implemented")):
        quantize_fp8.STAGE.run(cfg, eagle3_store["inputs"], tmp_path / "q")


# --------------------------------------------------------------------------- the release folder


def test_the_release_folder_is_the_head_vllm_loads_from_the_repo_root(eagle3_store, release):
    out, train = release["out"], eagle3_store["inputs"]["train"].path / EAGLE3_DIR
    paths = {f["path"] for f in release["res"]["files"]}
    assert {"config.json", "model.safetensors", "README.md", "release.json"} <= paths
    assert not any(p.startswith(("fp8/", "exl3/", EAGLE3_DIR + "/")) for p in paths), paths
    assert "mtp-trained.safetensors" not in paths and "model.safetensors.index.json" not in paths
    assert (out / "model.safetensors").read_bytes() == (train / "model.safetensors").read_bytes()
    assert (out / "config.json").read_bytes() == (train / "config.json").read_bytes()
    conf = json.loads((out / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["architectures"] == ["Eagle3Speculator"]
    assert conf["speculators_config"]["verifier"]["name_or_path"] == TARGET
    assert conf["eagle_aux_hidden_state_layer_ids"] == AUX and conf["draft_vocab_size"] == VD
    head, layout = load_eagle3(out, embed_tokens=torch.zeros(V, H))
    assert layout == "speculators" and head.cfg.aux_layer_ids == AUX and head.cfg.draft_vocab_size == VD
    want = eagle3_store["tuned"].state_dict()
    for k, v in head.state_dict().items():
        if not k.startswith("embed_tokens."):
            assert torch.equal(v, want[k]), k
    assert head.draft_ids().tolist() == list(range(0, 2 * VD, 2))
    rel = json.loads((out / "release.json").read_text())
    assert rel["kind"] == "eagle3" and rel["release_id"] == release["res"]["release_id"]
    assert rel["metrics"]["eagle3"]["config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert rel["schedule"]["speculative_config"]["model"].startswith("<local path>/")  # as the A/B served it, redacted
    assert (out / "assets" / "tok_s_vs_concurrency.png").is_file()
    root = str(eagle3_store["root"])
    for p in out.rglob("*"):
        if p.is_file() and p.suffix in (".md", ".json"):
            assert root not in p.read_text(), p


# --------------------------------------------------------------------------- the card


def test_the_eagle3_card_front_matter_and_usage(eagle3_store, release):
    md = release["md"]
    card = ModelCard(md)
    assert card.data.tags[:4] == ["speculative-decoding", "draft-model", "eagle3", "speculators"]
    assert card.data.library_name == "vllm" and card.data.base_model == TARGET
    ev = json.loads((eagle3_store["inputs"]["eval_offline"].path / "eval_offline.json").read_text())
    results = {r.metric_config: r.metric_value for r in card.data.eval_results}
    assert results["k4-t0-all"] == round(ev["drafters"]["candidate"]["t0"]["tau_by_k"][3], 3)
    assert "\n# tiny-eagle3: fine-tuned EAGLE-3 head for org/tiny-llama\n" in md
    summary = section(md, "## Summary")
    assert f"layers {AUX}" in summary and f"draft vocabulary of {VD} of the target's {V} tokens" in summary
    assert f"training-time test over K={HEAD_K} steps" in summary
    usage = section(md, "## Usage")
    ab = json.loads((eagle3_store["inputs"]["ab_live"].path / "ab_live.json").read_text())
    line = next(ln for ln in usage.splitlines() if ln.startswith('vllm serve "$TARGET" --speculative-config '))
    assert line.startswith(f'vllm serve "$TARGET" --speculative-config \'{{"method": "eagle3", "model": "{REPO}", ')
    served = json.loads(line.split("'")[1])  # the schedule the A/B derived, with the repo in place of its local folder
    assert served == ab["schedule"]["speculative_config"] | {"model": REPO}
    assert served["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 1024, 0]]
    assert f"`speculators_config.verifier` names the target\n(`{TARGET}`)" in usage
    assert f"`vllm serve {REPO}` alone should also work (not run by this pipeline)" in usage and f"K={HEAD_K}" in usage
    # the T=1 advice quotes the config the A/B served, with the repo in place of the local folder
    speed = section(md, "## Speed vs concurrency")
    assert f'"method": "eagle3", "model": "{REPO}"' in speed and "<local path>" not in speed


def test_the_eagle3_card_numbers_come_from_the_stage_outputs(eagle3_store, release):
    md, inputs = release["md"], eagle3_store["inputs"]
    ev = json.loads((inputs["eval_offline"].path / "eval_offline.json").read_text())
    served = {r["rule"]: r for r in table(section(md, "### At the served K=4"))}
    c = ev["drafters"]["candidate"]["t0"]
    assert served["T=0 (greedy target)"]["fine-tuned τ"] == f"{c['tau_by_k'][3]:.3f}"
    assert f"tokens: released {VD}, fine-tuned {VD}" in section(md, "## Offline results")
    live = section(md, "## Live A/B")
    assert "method `eagle3`, K=4" in live
    rows = {(r["T"], r["drafter"], r["users"]): r for r in table(live)}
    ab = json.loads((inputs["ab_live"].path / "ab_live.json").read_text())
    assert rows[("0", "fine-tuned", "1")]["tok/s"] == f"{ab['summary']['t0/candidate/greedy/c1']['tok_s']:.2f}"
    quant = section(md, "## Quantized forms")
    assert "not measured: quantize_fp8 was skipped (the released EAGLE-3 head <local path>/eagle3 is not FP8" in quant
    assert "exllamav3 has no EAGLE-3 head architecture" in quant
    train = section(md, "## Training")
    res = json.loads((inputs["train"].path / "result.json").read_text())
    assert f"trainable: {res['trainable']} parameters" in train
    assert f"`fc` over the target's layers {AUX}, `norm`, `lm_head` over {VD} of {V} tokens" in train
    assert "the `bootstrap_drafter` stage's (demo stand-in" in train
    gate = json.loads((inputs["gate"].path / "gate.json").read_text())
    assert f"Verdict: **{gate['verdict']}**" in section(md, "## Release gate")


def test_without_a_live_ab_the_card_serves_the_heads_k_and_names_the_eagle_layout(eagle3_store, tmp_path):
    """ab_live skipped: the usage line is the fixed K of the head's speculators config, the live and speed sections
    say why they are missing; a head in the EAGLE layout names no target, so only the long form is offered."""
    inputs = dict(eagle3_store["inputs"])
    inputs["ab_live"] = Artifact("ab_live", "a" * 16, tmp_path, {"status": "skipped", "reason": "needs vLLM"})
    md = str(render_card(card_context(eagle3_store["cfg"], inputs, files=[], repo_id=REPO, version="0.1.0",
                                      git_commit=None), kind="eagle3"))
    usage = section(md, "## Usage")
    assert (f'--speculative-config \'{{"method": "eagle3", "model": "{REPO}", "num_speculative_tokens": {HEAD_K}}}\''
            in usage)
    assert "not measured: ab_live was skipped (needs vLLM)" in section(md, "## Live A/B")
    assert "not measured: ab_live was skipped (needs vLLM)" in section(md, "## Speed vs concurrency")
    assert f"### At the served K={HEAD_K}" in md
    eagle = tmp_path / "train"
    write_head(eagle / EAGLE3_DIR, seed=1, layout="eagle")
    (eagle / "result.json").write_text((inputs["train"].path / "result.json").read_text())
    inputs["train"] = Artifact("train", "t" * 16, eagle, {"status": "done"})
    md = str(render_card(card_context(eagle3_store["cfg"], inputs, files=[], repo_id=REPO, version="0.1.0",
                                      git_commit=None), kind="eagle3"))
    usage = section(md, "## Usage")
    assert "original EAGLE-3 layout (`architectures: [LlamaForCausalLMEagle3]`" in usage
    assert "alone should also work" not in usage and f"layers {AUX}" in section(md, "## Summary")


def test_an_eagle3_card_with_no_stage_output_says_not_measured():
    """Nothing ran: every section says why; the usage line still names the repo and the configured K."""
    md = str(render_card(card_context(_config(), {}, files=[], repo_id=REPO, version="0.1.0", git_commit=None),
                         kind="eagle3"))
    assert "not measured: the train stage did not run for this release" in section(md, "## Summary")
    assert "not measured: the train stage did not run for this release" in section(md, "## Training")
    assert (f'\'{{"method": "eagle3", "model": "{REPO}", "num_speculative_tokens": {HEAD_K}}}\''
            in section(md, "## Usage"))
    assert "speculators_config" not in section(md, "## Usage")  # no head to describe
    assert ModelCard(md).data.tags[:4] == ["speculative-decoding", "draft-model", "eagle3", "speculators"]
