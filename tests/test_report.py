"""The release report assembles the demo's table from stage outputs: offline τ at the live K, live τ,
tok/s per concurrency and the speedup against no speculation; FP8 counts; why EXL3 is missing."""
from __future__ import annotations

from drafter.core.files import write_json_atomic
from drafter.evaluation.report import release_report
from tests.test_gate import ab_live, eval_offline


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
    none1, cand1 = ab["summary"]["none/none/c1"]["tok_s"], ab["summary"]["candidate/greedy/c1"]["tok_s"]
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
