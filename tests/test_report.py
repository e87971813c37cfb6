"""The release report assembles the demo's table from stage outputs: offline τ at the live K, live τ,
tok/s per concurrency and the speedup against no speculation; FP8 counts; why EXL3 is missing."""
from __future__ import annotations

from drafter.core.files import write_json_atomic
from drafter.evaluation.report import release_report
from tests.test_gate import ab_live, eval_offline, legacy


def test_report_rows_numbers_and_skips(tmp_path):
    ab, ev = ab_live(), eval_offline()
    write_json_atomic(tmp_path / "ab" / "ab_live.json", ab)
    write_json_atomic(tmp_path / "ev" / "eval_offline.json", ev)
    summary = {"stages": [
        {"stage": "eval_offline", "status": "computed", "path": str(tmp_path / "ev"), "metrics": {}},
        {"stage": "quantize_fp8", "status": "reused", "path": str(tmp_path / "q"),
         "metrics": {"tensors": 35, "fp8_tensors": 4, "kept_tensors": 12, "max_fp8_rel_error": 0.0264,
                     "max_fp8_rel_error_tensor": "model.layers.30.self_attn.v_proj.weight"}},
        {"stage": "verify_fp8", "status": "computed", "path": str(tmp_path / "v"),
         "metrics": {"rule": "float32 128x128", "blocks_identical": 610, "blocks_edge": 0, "blocks_differ": 0,
                     "blocks_total": 610, "dropin_keys_ok": True, "vllm_load": "unsupported: needs AMX"}},
        # reused from an earlier run that skipped it: still reported as not produced
        {"stage": "quantize_exl3", "status": "reused", "path": "", "reason": "needs CUDA: no CUDA device", "metrics": {}},
        {"stage": "ab_live", "status": "computed", "path": str(tmp_path / "ab"), "metrics": {}},
    ]}
    text = release_report(summary)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # offline τ at K=4 (t0) from eval_offline; live τ; tok/s at 1 and 8 users; speedup vs no speculation
    cand = rows["fine-tuned"].strip("| ").split(" | ")
    assert cand[1] == f"{ev['drafters']['candidate']['t0']['tau_by_k'][3]:.3f}" and cand[2] == "1.720"
    none1, cand1 = ab["summary"]["t0/none/none/c1"]["tok_s"], ab["summary"]["t0/candidate/greedy/c1"]["tok_s"]
    assert cand[3] == f"{cand1:.1f}" and cand[5] == f"{cand1 / none1:.2f}×"
    assert rows["no speculation"].strip("| ").split(" | ")[5] == "1.00×"
    assert "610 blocks byte-identical" in text and "0 differ (of 610)" in text and "0.0264" in text
    assert "EXL3**: not produced — needs CUDA" in text and "8/8 prompts identical" in text
    # decode speed without the prefill, from vLLM's histograms: 50, 65, 68.75 tok/s at 1 user
    assert ("Decode only at 1 user (vLLM's request histograms, the prompt's prefill excluded): no speculation "
            "50.0 tok/s; released 65.0 (1.30×); fine-tuned 68.8 (1.38×); mean time to first token 0.30 s.") in text
    # an ab_live.json without server timing (older outputs) has no such line
    for e in ab["summary"].values():
        e.pop("decode_tok_s")
    write_json_atomic(tmp_path / "ab" / "ab_live.json", ab)
    assert "Decode only" not in release_report(summary)
    # one temperature, one method: no second table
    assert "Every temperature and draft sampling method" not in text
    assert "A/B servers: eager (--enforce-eager: no graph capture)." in text


def _report(tmp_path, ab: dict, ev: dict) -> str:
    write_json_atomic(tmp_path / "ab" / "ab_live.json", ab)
    write_json_atomic(tmp_path / "ev" / "eval_offline.json", ev)
    return release_report({"stages": [
        {"stage": "eval_offline", "status": "computed", "path": str(tmp_path / "ev"), "metrics": {}},
        {"stage": "ab_live", "status": "computed", "path": str(tmp_path / "ab"), "metrics": {}}]})


def test_report_lists_every_temperature_and_method_and_the_compiled_servers(tmp_path):
    tok1 = {1: (30.0, 33.0, 36.0), 8: (120.0, 126.0, 132.0)}
    ab = ab_live(plan={0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]},
                 other={(1.0, "greedy"): (1.40, 1.50, tok1), (1.0, "probabilistic"): (1.55, 1.65, tok1)})
    ab["compiled"] = True
    ev = eval_offline()
    text = _report(tmp_path, ab, ev)
    # the primary table (T=0, greedy) is unchanged: live τ 1.720, offline at t0
    first = [ln for ln in text.splitlines() if ln.startswith("| fine-tuned |")][0].strip("| ").split(" | ")
    assert first[1] == f"{ev['drafters']['candidate']['t0']['tau_by_k'][3]:.3f}" and first[2] == "1.720"
    assert "A/B servers: compiled (CUDA graphs / torch.compile)." in text
    table = text.split("Every temperature and draft sampling method", 1)[1]
    rows = [ln.strip("| ").split(" | ") for ln in table.splitlines() if ln.startswith("| ")]
    assert rows[0] == ["T", "draft sampling", "drafter", "live τ (c1)", "tok/s c1", "tok/s c8", "speedup c1", "speedup c8"]
    body = {(r[0], r[1], r[2]): r[3:] for r in rows[1:]}
    assert list(body) == [("0", "—", "no speculation"), ("0", "greedy", "released"), ("0", "greedy", "fine-tuned"),
                          ("1", "—", "no speculation"), ("1", "greedy", "released"), ("1", "greedy", "fine-tuned"),
                          ("1", "probabilistic", "released"), ("1", "probabilistic", "fine-tuned")]
    # T=1 probabilistic fine-tuned: τ 1.65; 36 and 132 tok/s (means of ±0.5 % rounds) over no speculation at T=1
    assert body[("1", "probabilistic", "fine-tuned")] == ["1.650", "36.0", "132.0", "1.20×", "1.10×"]
    assert body[("1", "—", "no speculation")] == ["—", "30.0", "120.0", "1.00×", "1.00×"]


def test_report_reads_an_older_ab_live_json(tmp_path):
    """Outputs written before temperatures were a list (keys <drafter>/<method>/c<c>, one temperature)."""
    ab, ev = ab_live(), eval_offline()
    new, old = _report(tmp_path / "new", ab, ev), _report(tmp_path / "old", legacy(ab), ev)
    assert old == new.replace("A/B servers: eager (--enforce-eager: no graph capture).\n\n", "")
    assert "| fine-tuned |" in old
