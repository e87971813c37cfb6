"""The model card and the release folder (drafter.release.card / folder), on the session's finished store:
every number in the card's tables equals the stage json it came from at the precision shown; a missing
stage says "not measured" and why; the forced warning iff forced; release_id stable; no local path,
user or host name in any file of the folder."""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from drafter.core.config import ReleaseConfig
from drafter.core.stage import Artifact
from drafter.evaluation.ab_live import schedule_json
from drafter.release.card import NOT_MEASURED, card_context, redact_local, render_card, required_missing
from drafter.release.folder import build_release_folder
from drafter.release.redact import redact_obj

RULES = {"T=0 (greedy target)": "t0", "T=1, greedy drafts (vLLM default)": "t1_greedy",
         "T=1, probabilistic drafts": "t1_prob"}


# --------------------------------------------------------------------------- helpers


def section(md: str, heading: str) -> str:
    """The text under ``heading`` (a '## ' or '### ' line) up to the next heading of the same or higher level."""
    level = heading.split(" ")[0]
    lines = md.splitlines()
    start = lines.index(heading)
    out = []
    for ln in lines[start + 1:]:
        if ln.startswith("#") and len(ln.split(" ")[0]) <= len(level):
            break
        out.append(ln)
    return "\n".join(out)


def table(text: str) -> list[dict]:
    """The first markdown table in ``text`` as rows keyed by header."""
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    header, body = split[0], [r for r in split[2:]]
    return [dict(zip(header, r)) for r in body]


def read(art: Artifact, name: str) -> dict:
    return json.loads((Path(art.path) / name).read_text())


def build(fs, out: Path, inputs=None, repo_id="test-org/tiny-mtp"):
    return build_release_folder(fs["cfg"], inputs if inputs is not None else fs["inputs"], out, version="0.1.0",
                                git_commit="0123456789abcdef", repo_id=repo_id)


@pytest.fixture(scope="module")
def release(finished_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "release"
    res = build(finished_store, out)
    return {"out": out, "res": res, "md": (out / "README.md").read_text(), "fs": finished_store}


# --------------------------------------------------------------------------- fast unit tests


def test_minimal_inputs_say_not_measured(tmp_path):
    cfg = ReleaseConfig.model_validate({"prepare_target": {"source": "hub", "hub_id": "org/big", "revision": "abc"},
                                        "publish": {"tags": ["x"], "datasets": ["org/data"]}})
    assert required_missing({}) == [f"{s}: {NOT_MEASURED}: the {s} stage did not run for this release"
                                    for s in ("prepare_target", "train", "gate")]
    skipped = {"ab_live": Artifact("ab_live", "k", tmp_path, {"status": "skipped", "reason": f"no vLLM at {tmp_path}"})}
    ctx = card_context(cfg, skipped, files=[], repo_id=None, version="0.1.0", git_commit=None)
    card = render_card(ctx)
    text = str(card)
    assert f"{NOT_MEASURED}: ab_live was skipped (no vLLM at <local path>/" in text and str(tmp_path) not in text
    assert f"{NOT_MEASURED}: the eval_offline stage did not run" in text
    assert f"{NOT_MEASURED}: the train stage did not run" in text
    assert "hf download ORG/NAME --local-dir drafter" in text
    back = ModelCard(text)
    assert back.data.base_model == "org/big" and back.data.license == "other" and back.data.datasets == ["org/data"]
    assert back.data.tags == ["speculative-decoding", "draft-model", "mtp", "vllm", "x"]
    assert "WARNING" not in text


def _live_inputs(tmp_path, ab: dict, ev: dict | None = None, serving: dict | None = None) -> dict:
    """Card inputs with recorded ab_live (and eval_offline) outputs, no other stage."""
    from drafter.core.files import write_json_atomic

    ab = ab | {"replay": {"turns": 16, "conversations": 4, "domains": ["agent"], "max_tokens": 128, "notes": []},
               "server_args": ["--block-size", "32"], "hardware": None}
    write_json_atomic(tmp_path / "ab_live" / "ab_live.json", ab)
    conf = {"serving": ReleaseConfig().serving.key_dump() | (serving or {}), "ab_live": ReleaseConfig().ab_live.key_dump()}
    inputs = {"ab_live": Artifact("ab_live", "a" * 16, tmp_path / "ab_live", {"config": conf})}
    if ev is not None:
        write_json_atomic(tmp_path / "eval_offline" / "eval_offline.json", ev | {
            "confidence": 0.95, "positions": 100, "conversations": 4, "windows": 8, "bootstrap_samples": 50})
        inputs["eval_offline"] = Artifact("eval_offline", "e" * 16, tmp_path / "eval_offline")
    return inputs


def test_card_live_table_has_a_row_per_temperature_and_method_and_says_compiled(tmp_path):
    from tests.test_gate import ab_live, eval_offline

    tok1 = {1: (30.0, 33.0, 36.0), 8: (120.0, 126.0, 132.0)}
    ab = ab_live(plan={0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]},
                 other={(1.0, "greedy"): (1.40, 1.50, tok1), (1.0, "probabilistic"): (1.55, 1.65, tok1)})
    ab["compiled"] = True
    ab["unsupported"] = {"probabilistic at T=0": "at temperature 0 vLLM drafts greedily"}
    cfg = ReleaseConfig()
    ctx = card_context(cfg, _live_inputs(tmp_path, ab, eval_offline()), files=[], repo_id=None, version="0.1.0",
                       git_commit=None)
    md = str(render_card(ctx))
    live = section(md, "## Live A/B")
    assert "temperatures 0, 1;" in live and "servers compiled (CUDA graphs / torch.compile);" in live
    assert "--enforce-eager" not in live  # compiled servers: the flag is not in the server arguments
    rows = table(live)
    assert len(rows) == len(ab["summary"]) == 16
    got = {(r["T"], r["drafter"], r["draft sampling"], r["users"]): r for r in rows}
    r = got[("1", "fine-tuned", "probabilistic", "1")]
    assert (r["τ"], r["tok/s"], r["× no speculation"]) == ("1.650", "36.00", "1.20")
    r = got[("1", "no speculation", "—", "8")]
    assert (r["τ"], r["tok/s"], r["× no speculation"]) == ("—", "120.00", "1.00")
    r = got[("0", "fine-tuned", "greedy", "1")]
    assert (r["τ"], r["tok/s"], r["× no speculation"]) == ("1.720", "55.00", "1.38")
    assert [k[0] for k in got] == ["0"] * 6 + ["1"] * 10  # temperature first, then users
    # live / offline τ at the primary measurement (T=0, greedy drafts, the t0 rule)
    off = eval_offline()["drafters"]["candidate"]["t0"]["tau_by_k"][3]
    assert (f"live at T=0 with greedy drafts, offline T=0 (greedy target)): 1.720 / {off:.3f} = {1.72 / off:.3f}"
            in live)
    assert "draft sampling `probabilistic at T=0`: not measured: at temperature 0 vLLM drafts greedily" in live
    assert "compiled (CUDA graphs / torch.compile), over 16 replayed turns" in md  # limitations
    # the usage line serves as the A/B did: compiled, no --enforce-eager
    usage = section(md, "## Usage")
    assert "--block-size 32" in usage and "--enforce-eager" not in usage
    # eager servers: said so, and the flag is in the usage line
    ab["compiled"] = False
    md = str(render_card(card_context(cfg, _live_inputs(tmp_path / "eager", ab), files=[], repo_id=None,
                                      version="0.1.0", git_commit=None)))
    assert "servers eager (--enforce-eager: no graph capture);" in section(md, "## Live A/B")
    assert "--enforce-eager" in section(md, "## Usage")


def test_card_reads_an_older_ab_live_json(tmp_path):
    """An ab_live.json without ``compiled`` and with summary keys <drafter>/<method>/c<c>: one temperature, eager
    or compiled as its serving config said."""
    from tests.test_gate import ab_live, legacy

    ab = legacy(ab_live())
    ctx = card_context(ReleaseConfig(), _live_inputs(tmp_path, ab, serving={"enforce_eager": False}), files=[],
                       repo_id=None, version="0.1.0", git_commit=None)
    live = section(str(render_card(ctx)), "## Live A/B")
    assert "temperature 0;" in live and "servers compiled (CUDA graphs / torch.compile);" in live
    rows = table(live)
    assert len(rows) == 6 and {r["T"] for r in rows} == {"0"}
    assert [r["tau"] for r in ctx["live"]["rows"] if r["drafter"] == "fine-tuned"] == ["1.720", "1.720"]


def test_redact_local():
    assert redact_local("python at /home/someone/venv/bin/python, ok") == "python at <local path>/python, ok"
    assert redact_local("tok/s and K/V stay") == "tok/s and K/V stay"
    assert socket.gethostname() not in redact_local(f"host {socket.gethostname()}") or len(socket.gethostname()) <= 2


# --------------------------------------------------------------------------- the finished store


@pytest.mark.slow
def test_fixture_ran_every_stage(finished_store):
    st = {s["stage"]: s["status"] for s in finished_store["summary"]["stages"]}
    print(f"\nfinished store built in {finished_store['seconds']:.1f} s: {st}")
    assert st["ab_live"] in ("computed", "reused") and st["quantize_fp8"] in ("computed", "reused")
    assert st["quantize_exl3"] == "skipped" and set(finished_store["inputs"]) >= {"gate", "ab_live", "verify_fp8"}


@pytest.mark.slow
def test_front_matter_round_trip(release):
    inputs = release["fs"]["inputs"]
    card = ModelCard.load(release["out"] / "README.md")
    d = card.data
    tgt = read(inputs["prepare_target"], "target.json")
    assert d.pipeline_tag == "text-generation" and d.library_name == "vllm"
    assert d.license == "other" and d.base_model is None  # a local path target: no Hub base model, license unknown
    assert d.tags == ["speculative-decoding", "draft-model", "mtp", "vllm", "tiny-test"]
    assert d.model_name == "tiny-mtp"
    ev = read(inputs["eval_offline"], "eval_offline.json")
    k = read(inputs["ab_live"], "ab_live.json")["num_speculative_tokens"]
    cand = ev["drafters"]["candidate"]
    want = {}
    for rule, label in (("t0", "T=0"), ("t1_greedy", "T=1")):
        want[("all", label)] = round(cand[rule]["tau_by_k"][k - 1], 3)
        for dom, s in cand[rule]["by_domain"].items():
            want[(dom, label)] = round(s["tau_by_k"][k - 1], 3)
    got = {(r.dataset_config, re.search(r"T=[01]", r.metric_name).group(0)): r.metric_value for r in d.eval_results}
    assert got == want and all(r.metric_type == "acceptance_length" for r in d.eval_results)
    assert tgt["chat_template_sha256"] in card.text


@pytest.mark.slow
def test_offline_tables_equal_the_stage_json(release):
    inputs, md = release["fs"]["inputs"], release["md"]
    ev = read(inputs["eval_offline"], "eval_offline.json")
    k = read(inputs["ab_live"], "ab_live.json")["num_speculative_tokens"]
    d = ev["drafters"]
    served = table(section(md, f"### At the served K={k}"))
    assert [RULES[r["rule"]] for r in served] == ["t0", "t1_greedy", "t1_prob"]
    for r in served:
        rule = RULES[r["rule"]]
        assert r["released τ"] == f"{d['baseline'][rule]['tau_by_k'][k - 1]:.3f}"
        assert r["fine-tuned τ"] == f"{d['candidate'][rule]['tau_by_k'][k - 1]:.3f}"
        lo, hi = d["candidate"][rule]["tau_ci"][k - 1]
        assert r["CI"] in (f"[{lo:.3f}, {hi:.3f}]", r["CI"]) and f"[{lo:.3f}, {hi:.3f}]" in " ".join(r.values())
        assert r["Δτ"] == f"{ev['difference'][rule]['tau_by_k'][k - 1]:+.3f}"
        lo, hi = ev["difference"][rule]["tau_ci"][k - 1]
        assert r["Δ CI"] == f"[{lo:.3f}, {hi:.3f}]"
    by_k = table(section(md, "### τ by K (released / fine-tuned)"))
    assert [int(r["K"]) for r in by_k] == list(range(1, ev["k_max"] + 1))
    for r in by_k:
        kk = int(r["K"])
        for label, rule in RULES.items():
            assert r[f"{label}: released"] == f"{d['baseline'][rule]['tau_by_k'][kk - 1]:.3f}"
            assert r[f"{label}: fine-tuned"] == f"{d['candidate'][rule]['tau_by_k'][kk - 1]:.3f}"
    dom = table(section(md, f"### Per domain (K={k})"))
    assert sorted(r["domain"] for r in dom) == sorted(d["candidate"]["t0"]["by_domain"])
    for r in dom:
        s = d["candidate"]["t0"]["by_domain"][r["domain"]]
        assert int(r["positions"]) == s["positions"] and int(r["conversations"]) == s["conversations"]
        for label, rule in RULES.items():
            assert r[f"{label}: fine-tuned"] == f"{d['candidate'][rule]['by_domain'][r['domain']]['tau_by_k'][k - 1]:.3f}"
    assert f"{ev['positions']} draft positions" in md and f"{ev['windows']} windows" in md


@pytest.mark.slow
def test_live_table_equals_the_stage_json(release):
    inputs, md = release["fs"]["inputs"], release["md"]
    ab = read(inputs["ab_live"], "ab_live.json")
    rows = table(section(md, "## Live A/B"))
    names = {"no speculation": "none", "released": "baseline", "fine-tuned": "candidate",
             "schedule (released configuration)": "schedule"}
    names |= {f"fine-tuned, K={k}": f"candidate-k{k}" for k in range(1, 17)}  # the sweep's other Ks
    assert len(rows) == len(ab["summary"])
    for r in rows:
        key = f"t{r['T']}/{names[r['drafter']]}/{'none' if r['draft sampling'] == '—' else r['draft sampling']}/c{r['users']}"
        s = ab["summary"][key]
        none = ab["summary"][f"t{r['T']}/none/none/c{r['users']}"]
        assert r["τ"] == ("—" if s["tau"] is None else f"{s['tau']:.3f}")
        assert r["tok/s"] == f"{s['tok_s']:.2f}" and r["decode tok/s"] == f"{s['decode_tok_s']:.2f}"
        assert r["× no speculation"] == f"{s['tok_s'] / none['tok_s']:.2f}"
        assert r["TTFT mean (s)"] == f"{s['ttft_mean_s']:.3f}" and r["latency p50 (s)"] == f"{s['latency_p50_s']:.3f}"
    assert f"vLLM {ab['engine_version']}" in md and "--block-size 32" in md
    assert "servers eager (--enforce-eager: no graph capture)" in md and ab["compiled"] is False
    assert f"{ab['lossless']['identical']}/{ab['lossless']['prompts']} prompts identical" in md


@pytest.mark.slow
def test_quant_training_and_gate_sections(release):
    inputs, md = release["fs"]["inputs"], release["md"]
    err = read(inputs["quantize_fp8"], "fp8/fp8-error.json")["summary"]
    ver = read(inputs["verify_fp8"], "verify.json")["self_check"]["totals"]
    q = section(md, "### FP8 drop-in (`fp8/`)")
    assert f"{err['max_fp8_rel_error']:.2e}" in q and f"{err['max_moved_rel']:.2e}" in q
    assert f"{ver['identical']} / {ver['edge']} / {ver['differ']} / {ver['total']}" in q
    exl3 = section(md, "### EXL3 (`exl3/`)")
    assert "not produced: quantize_exl3 was skipped" in exl3 and "needs CUDA" in exl3
    res = read(inputs["train"], "result.json")
    tr = section(md, "## Training")
    assert f"wall time {res['seconds']:.1f} s" in tr and f"{res['trainable']} parameters" in tr
    assert f"tokens, {res['dtype']}" in tr  # the compute dtype the run used (train.dtype auto resolved)
    gate = read(inputs["gate"], "gate.json")
    rows = table(section(md, "## Release gate"))
    assert [r["check"] for r in rows] == [c["name"] for c in gate["checks"]]
    for r, c in zip(rows, gate["checks"]):
        assert r["value"] == f"{c['value']:.4g}" and r["result"] == ("pass" if c["passed"] else "FAIL")
    # forced warning iff forced
    assert ("FORCED RELEASE" in md) == bool(gate["forced"])
    if gate["forced"]:
        body = md.split("\n---\n", 1)[1]
        assert body.index("FORCED RELEASE") < body.index("## Summary")


@pytest.mark.slow
def test_usage_block_and_index(release):
    out, md = release["out"], release["md"]
    usage = section(md, "## Usage")
    blocks = re.findall(r"```bash\n(.*?)```", usage, re.S)
    # the A/B's schedule is the usage line's --speculative-config; where speculation paid nowhere, the target is
    # served without it first and the drafter's block (the fixed K) follows, at the reader's own risk
    sched = read(release["fs"]["inputs"]["ab_live"], "ab_live.json").get("schedule")
    nowhere = bool(sched) and sched["speculative_config"] is None
    assert len(blocks) == 1 + nowhere and usage.count("```") == 2 * len(blocks)
    if nowhere:
        assert blocks[0].strip().splitlines()[-1].startswith('vllm serve "$TARGET" --dtype float32')
        assert "--speculative-config" not in blocks[0]
    want = sched["speculative_config"] if sched and not nowhere else {"method": "mtp", "num_speculative_tokens": 2}
    lines = blocks[-1].strip().splitlines()
    assert lines[0].startswith("hf download test-org/tiny-mtp --local-dir drafter")
    assert lines[1].startswith("TARGET=/path/to/")
    assert lines[2] == 'mkdir served && ln -s "$TARGET"/* served/ && rm served/model.safetensors.index.json'
    # the drafter's draft vocabulary (train.draft_vocab_size 64 in the finished store) goes next to it
    assert lines[3] == "cp drafter/mtp-trained.safetensors drafter/model.safetensors.index.json drafter/draft_vocab.safetensors served/"
    assert "`draft_vocab.safetensors` holds the 64 tokens the drafter proposes" in usage
    assert lines[4].startswith(f"vllm serve served --speculative-config '{schedule_json(want)}'")
    argv = shlex.split(lines[4])
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == want
    assert "--dtype float32 --max-model-len 1024" in lines[4] and "--port" not in lines[4]
    from safetensors import safe_open

    with safe_open(str(out / "mtp-trained.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for k, v in wm.items() if v == "mtp-trained.safetensors"} == keys
    from drafter.models.target import target_dir

    tgt = json.loads((target_dir(release["fs"]["inputs"]["prepare_target"]) /
                      "model.safetensors.index.json").read_text())["weight_map"]
    assert set(wm) == set(tgt) and all(wm[k] == tgt[k] for k in tgt if k not in keys)


@pytest.mark.slow
def test_files_table_matches_the_files(release):
    out, md, res = release["out"], release["md"], release["res"]
    rows = {r["file"].strip("`"): r for r in table(section(md, "## Files"))}
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(rows) == on_disk == sorted(f["path"] for f in res["files"])
    for path, r in rows.items():
        if path in ("README.md", "release.json"):
            continue
        data = (out / path).read_bytes()
        assert int(r["size (bytes)"]) == len(data) and r["sha256"].strip("`") == hashlib.sha256(data).hexdigest()
    assert rows["mtp-trained.safetensors"]["tensors"] != "—" and "F32" in rows["mtp-trained.safetensors"]["dtypes"]
    for f in res["files"]:
        assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    rel = json.loads((out / "release.json").read_text())
    assert rel["release_id"] == res["release_id"] and {f["path"] for f in rel["files"]} == set(on_disk) - {"release.json"}
    assert set(rel["stage_keys"]) >= {"train", "gate", "ab_live"} and rel["metrics"]["live"]["summary"]
    assert {"fp8/mtp-ft.safetensors", "fp8/model.safetensors.index.json", "fp8/fp8-error.json", "fp8/verify.json",
            "assets/tau_vs_k.png", "assets/train_curves.png", "assets/tok_s_vs_concurrency.png",
            "draft_vocab.safetensors"} <= set(on_disk)
    assert rel["schedule"] == redact_obj(read(release["fs"]["inputs"]["ab_live"], "ab_live.json").get("schedule"))
    assert "the draft vocabulary" in rows["draft_vocab.safetensors"]["what it is"]
    assert re.search(r"- draft vocabulary: 64 of \d+ tokens .*; \d+\.\d % of the held-out", md)


@pytest.mark.slow
def test_no_local_path_user_or_host_in_any_file(release):
    words = {os.getcwd(), str(Path.home()), socket.gethostname(), "/tmp/", "/work/"}
    user = getpass.getuser()
    if len(user) > 2:
        words.add(user)
    words |= {str(release["out"]), str(release["fs"]["store"].root_url) if hasattr(release["fs"]["store"], "root_url")
              else ""}
    words = {w for w in words if w and w != "/"}
    checked = 0
    for p in release["out"].rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            text = p.suffix in (".md", ".json")
            for w in words:
                if len(w) >= 4:
                    assert w.encode() not in data, f"{w!r} in {p.relative_to(release['out'])}"
                elif text:  # a short host name ("vm") occurs by chance in weights: as a word, in text files
                    assert not re.search(rf"\b{re.escape(w)}\b", data.decode()), f"{w!r} in {p.relative_to(release['out'])}"
            checked += 1
    assert checked >= 8


@pytest.mark.slow
def test_missing_stages_say_not_measured(finished_store, tmp_path):
    inputs = {k: v for k, v in finished_store["inputs"].items() if k not in ("ab_live", "quantize_fp8", "verify_fp8")}
    build(finished_store, tmp_path / "r", inputs=inputs, repo_id=None)
    md = (tmp_path / "r" / "README.md").read_text()
    assert f"{NOT_MEASURED}: the ab_live stage did not run for this release" in section(md, "## Live A/B")
    assert f"{NOT_MEASURED}: the quantize_fp8 stage did not run" in section(md, "### FP8 drop-in (`fp8/`)")
    assert "hf download ORG/NAME --local-dir drafter" in md
    assert not (tmp_path / "r" / "fp8").exists()


@pytest.mark.slow
def test_release_id_stable_and_follows_the_files(finished_store, release, tmp_path):
    again = build(finished_store, tmp_path / "a")
    assert again["release_id"] == release["res"]["release_id"]
    ev = finished_store["inputs"]["eval_offline"]
    copy = tmp_path / "ev"
    shutil.copytree(ev.path, copy)
    with open(copy / "tau_vs_k.png", "ab") as f:
        f.write(b"\0")
    inputs = finished_store["inputs"] | {"eval_offline": Artifact("eval_offline", ev.key, copy, ev.manifest)}
    changed = build(finished_store, tmp_path / "b", inputs=inputs)
    assert changed["release_id"] != release["res"]["release_id"]
    with pytest.raises(Exception, match="not empty"):
        build(finished_store, tmp_path / "b")


@pytest.mark.slow
def test_forced_release_warns_at_the_top(finished_store, tmp_path):
    g = finished_store["inputs"]["gate"]
    copy = tmp_path / "gate"
    shutil.copytree(g.path, copy)
    doc = json.loads((copy / "gate.json").read_text())
    doc["checks"][0]["passed"] = False
    doc |= {"verdict": "forced", "forced": True, "failed": [doc["checks"][0]["name"]]}
    (copy / "gate.json").write_text(json.dumps(doc))
    inputs = finished_store["inputs"] | {"gate": Artifact("gate", g.key, copy, g.manifest)}
    build(finished_store, tmp_path / "r", inputs=inputs)
    md = (tmp_path / "r" / "README.md").read_text()
    body = md.split("\n---\n", 1)[1]
    assert "> [!WARNING]" in body and body.index("FORCED RELEASE") < body.index("## Summary")
    assert f"failed checks: {doc['checks'][0]['name']}" in body and "Verdict: **forced** (forced)" in body
    assert table(section(md, "## Release gate"))[0]["result"] == "FAIL"


def test_a_forced_gate_without_live_evidence_renders_its_check(tmp_path):
    """No vLLM (ab_live skipped): the forced gate's one check has no value or threshold — shown as "—"."""
    from drafter.core.config import GateConfig
    from drafter.evaluation.gate import gate_without_live
    from drafter.release.card_sections import gate_section as _gate

    d = tmp_path / "gate"
    d.mkdir()
    (d / "gate.json").write_text(json.dumps(gate_without_live("needs vLLM", GateConfig(force=True))))
    g = _gate({"gate": Artifact("gate", "k", d, {"status": "done"})})
    assert g["verdict"] == "forced" and g["forced"] and g["checks"][0]["passed"] == "FAIL"
    assert g["checks"][0]["value"] == g["checks"][0]["threshold"] == "—"
