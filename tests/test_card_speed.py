"""The card's speed against concurrency (drafter/release/card_speed.py): the usage line carries the A/B's schedule
as the exact JSON vLLM gets (or serves the target without speculation when it pays nowhere, or the fixed K for an
A/B without a sweep), the *Speed vs concurrency* table equals the A/B's numbers, the sentence on where speculation
pays, the advice for sampling at T > 0, the plot in the release folder and release.json's schedule."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from drafter.core.config import ReleaseConfig
from drafter.core.files import write_json_atomic
from drafter.core.stage import Artifact
from drafter.evaluation.ab_live import AbLiveResult, schedule_record, summarize, sweep_name, sweep_of
from drafter.release.card import card_context, render_card
from drafter.release.card_speed import SPEED_PLOT, plot_speed, ranges_text
from tests.test_card import section, table
from tests.test_gate import _run, ab_live

DEMO = Path(__file__).resolve().parent / "data" / "demo-results"
CONC = (1, 2, 4, 8)
# tok/s at T=0 per concurrency: (no speculation, released drafter K=4, fine-tuned K=4)
PAYS = {1: (40.0, 52.0, 55.0), 2: (78.0, 96.0, 100.0), 4: (150.0, 160.0, 165.0), 8: (280.0, 250.0, 240.0)}
SWEEP_PAYS = {1: {1: 48.0, 3: 57.0}, 2: {1: 92.0, 3: 101.0}, 4: {1: 158.0, 3: 170.0}, 8: {1: 270.0, 3: 250.0}}
SCHEDULE_TOK = {1: 56.5, 2: 100.8, 4: 169.0, 8: 279.0}
NOWHERE = {c: (n, n * 0.9, n * 0.95) for c, (n, _, _) in PAYS.items()}
SWEEP_NOWHERE = {c: {1: n * 0.97, 3: n * 0.93} for c, (n, _, _) in PAYS.items()}
# T=1: greedy drafts barely faster at 1 user, probabilistic ones 1.20× at 1 user … 0.90× at 8
T1_GREEDY = {c: (n, n * 1.0, n * 1.01) for c, n in ((1, 30.0), (2, 58.0), (4, 110.0), (8, 200.0))}
T1_PROB = {c: (n, n * 1.1, n * f) for (c, n), f in zip(((1, 30.0), (2, 58.0), (4, 110.0), (8, 200.0)),
                                                      (1.20, 1.10, 1.03, 0.90))}
T1_SLOW = {c: (n, n * 0.9, n * 0.95) for c, (n, _, _) in T1_GREEDY.items()}
REFUSAL = "ValueError: num_speculative_tokens_per_batch_size is not supported by this engine"


def ab_with_schedule(tok: dict, sweep_tok: dict, *, served: bool, t1: dict | None = None,
                     schedule_tok: dict | None = None) -> dict:
    """ab_live.json as the stage writes it since the sweep: K=4, T=0 greedy (and ``t1``: {method: tok} at T=1),
    the fine-tuned drafter at K=1 and 3 too (``candidate-k<K>``), the schedule derived from that sweep and, when
    ``served``, the ``schedule`` server's runs at every concurrency."""
    plan = {0.0: ["greedy"]} | ({1.0: list(t1)} if t1 else {})
    other = {(1.0, m): (1.4, 1.6, tk) for m, tk in (t1 or {}).items()}
    ab = ab_live(tok=tok, plan=plan, other=other)
    extra = []
    for c, by_k in sweep_tok.items():
        for k, ts in by_k.items():
            extra += [_run(sweep_name(k, 4), "greedy", c, r, ts * (1 + 0.01 * (r - 0.5)), 1.7) for r in (0, 1)]
    ab["runs"] += extra
    rec = schedule_record(sweep_of(ab["runs"], 0.0, "greedy", 4), 0.02, {"method": "mtp", "draft_sample_method": "greedy"},
                          temperature=0.0, method="greedy")
    if rec["speculative_config"] is None:
        rec["refusal"] = "speculation beats no speculation at no measured concurrency: the release serves without it"
    elif served:
        sched = [_run("schedule", "greedy", c, r, ts * (1 + 0.01 * (r - 0.5)), 1.7)
                 for c, ts in (schedule_tok or SCHEDULE_TOK).items() for r in (0, 1)]
        extra += sched
        ab["runs"] += sched
        rec["served"] = True
    else:
        rec["refusal"] = REFUSAL
    ab["summary"] |= summarize([r | {"k": None} for r in extra])
    ab["schedule"] = rec
    ab["servers"] = [{"round": 1, "drafter": "candidate", "draft_sample_method": m, "temperatures": [1.0],
                      "speculative_config": {"method": "mtp", "num_speculative_tokens": 4, "draft_sample_method": m}}
                     for m in (t1 or {})]
    return ab


def _inputs(tmp_path: Path, ab: dict, manifest: dict | None = None) -> dict:
    ab = ab | {"replay": {"turns": 16, "conversations": 4, "domains": ["agent"], "max_tokens": 128, "notes": []},
               "server_args": ["--block-size", "32"], "hardware": None}
    write_json_atomic(tmp_path / "ab_live" / "ab_live.json", ab)
    return {"ab_live": Artifact("ab_live", "a" * 16, tmp_path / "ab_live", manifest or {})}


def _card(inputs: dict, files: list | None = None) -> tuple[dict, str]:
    ctx = card_context(ReleaseConfig(), inputs, files=files or [], repo_id="org/tiny-mtp", version="0.1.0",
                       git_commit=None)
    return ctx, str(render_card(ctx))


def serve_lines(md: str) -> list[list[str]]:
    """The argv of every ``vllm serve`` line of the card's usage section, in order."""
    usage = section(md, "## Usage")
    return [shlex.split(ln, comments=True) for b in re.findall(r"```bash\n(.*?)```", usage, re.S)
            for ln in b.splitlines() if ln.startswith("vllm serve ")]


def spec_of(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def speed_rows(md: str) -> dict[str, dict]:
    """The speed table (the first of the section, before the sweep's) by users."""
    text = section(md, "## Speed vs concurrency")
    first = text[text.index("\n|"):].split("\n\n", 1)[0]
    return {r["users"]: r for r in table(first)}


# --------------------------------------------------------------------------- the usage line


def test_a_served_schedule_is_the_usage_lines_exact_json_and_the_table_holds_its_numbers(tmp_path):
    ab = ab_with_schedule(PAYS, SWEEP_PAYS, served=True, t1={"greedy": T1_GREEDY, "probabilistic": T1_PROB})
    sched = ab["schedule"]
    assert sched["ranges"] == [[1, 4, 3], [5, 1024, 0]] and sched["pays_up_to"] == 4  # K=3 pays up to 4 users
    ctx, md = _card(_inputs(tmp_path, ab))
    (argv,) = serve_lines(md)
    assert argv[:3] == ["vllm", "serve", "served"] and spec_of(argv) == sched["speculative_config"]
    assert spec_of(argv)["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 1024, 0]]
    assert json.loads(ctx["usage"]["speculative_config_json"]) == sched["speculative_config"]
    usage = section(md, "## Usage")
    assert "the batch-size schedule derived from the live A/B's sweep" in usage
    assert "1–4 requests: K=3; 5–1024 requests: off" in usage and "did not serve" not in usage

    rows = speed_rows(md)
    assert list(rows) == ["1", "2", "4", "8"]
    for c, (none, base, cand) in PAYS.items():
        r = rows[str(c)]
        rel = SCHEDULE_TOK[c]
        assert r["no speculation"] == f"{none:.1f}"
        assert r["released drafter, K=4"] == f"{base:.1f} ({base / none:.2f}×)"
        assert r["fine-tuned, K=4"] == f"{cand:.1f} ({cand / none:.2f}×)"
        assert r["released configuration"] == f"{rel:.1f} ({rel / none:.2f}×)"
        assert r["K served"] == ("3" if c <= 4 else "off") and r["released configuration measured as"] == "schedule (served)"
    speed = section(md, "## Speed vs concurrency")
    assert "**Speculation pays up to 4 concurrent users on this hardware.**" in speed
    assert "vLLM served the schedule itself in the A/B" in speed
    assert "| users | no speculation tok/s | K=1 tok/s | K=3 tok/s | K=4 tok/s |" in speed  # the sweep behind it
    assert ctx["raw"]["speed"]["schedule"] == json.loads(json.dumps(sched))
    # the live table names the sweep's servers and the schedule's
    live = {(r["drafter"], r["users"]): r for r in table(section(md, "## Live A/B"))}
    assert live[("fine-tuned, K=3", "1")]["tok/s"] == "57.00" and live[("schedule (released configuration)", "8")]
    # T=1: probabilistic drafts 1.20× at 1 user, > 2 % faster up to 4 users; greedy drafts only 1.01×
    (advice,) = section(md, "### Sampling (T > 0)").strip().splitlines()
    m = re.match(r"- At T=1, serve probabilistic drafts \(`--speculative-config '(.*?)'`, as the A/B served it\): "
                 r"1\.20× no speculation at 1 concurrent user, more than 2% faster up to 4 concurrent users ", advice)
    assert m, advice
    assert json.loads(m.group(1)) == {"method": "mtp", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}
    assert "greedy drafts 1.01× at 1, 1.01× at 2, 1.01× at 4, 1.01× at 8" in advice
    assert "probabilistic drafts 1.20× at 1, 1.10× at 2, 1.03× at 4, 0.90× at 8" in advice


def test_a_refused_schedule_is_still_the_usage_line_and_the_card_says_why(tmp_path):
    ab = ab_with_schedule(PAYS, SWEEP_PAYS, served=False)
    sched = ab["schedule"]
    ctx, md = _card(_inputs(tmp_path, ab))
    (argv,) = serve_lines(md)
    assert spec_of(argv) == sched["speculative_config"]
    usage = section(md, "## Usage")
    assert (f"The A/B did not serve the schedule itself ({REFUSAL}); a vLLM that refuses "
            "`num_speculative_tokens_per_batch_size` serves the fixed K instead: "
            """`--speculative-config '{"method": "mtp", "num_speculative_tokens": 4}'`.""") in usage
    rows = speed_rows(md)
    # derived: the fine-tuned drafter's fixed-K servers at the scheduled K (K=3 up to 4 users, no speculation at 8)
    for c, (none, _, _) in PAYS.items():
        rel = SWEEP_PAYS[c][3] if c <= 4 else none
        assert rows[str(c)]["released configuration"] == f"{rel:.1f} ({rel / none:.2f}×)"
        assert "not served" in rows[str(c)]["released configuration measured as"]
    speed = section(md, "## Speed vs concurrency")
    assert f"The schedule was not served in the A/B ({REFUSAL})" in speed
    assert "**Speculation pays up to 4 concurrent users on this hardware.**" in speed
    # no T > 0 measured: said so
    assert "T > 0 was not measured (the live A/B ran at T=0 only)" in section(md, "### Sampling (T > 0)")


def test_a_fixed_k_faster_than_the_served_schedule_is_the_usage_line(tmp_path):
    """vLLM served the schedule below the fixed K it schedules (the EAGLE-3 demo's case): the card serves fixed K=3
    up to the 4 users where it pays, with the numbers of its own server, and says why; release.json too."""
    slow = {1: 50.0, 2: 90.0, 4: 155.0, 8: 279.0}
    ab = ab_with_schedule(PAYS, SWEEP_PAYS, served=True, schedule_tok=slow)
    ctx, md = _card(_inputs(tmp_path, ab))
    (argv,) = serve_lines(md)
    assert spec_of(argv) == {"method": "mtp", "draft_sample_method": "greedy", "num_speculative_tokens": 3}
    usage = section(md, "## Usage")
    assert "serves the fixed K the live A/B's sweep found fastest — fixed K=3 up to 4 users: 1.20× no speculation " \
           "(geometric mean over 1, 2, 4, 8 users), faster than the schedule (served) at 1.10×" in usage
    assert "Above 4 users serve the target without the drafter: fixed K=3 did not beat no speculation beyond " \
           "noise there." in usage
    rows = speed_rows(md)
    for c, (none, _, _) in PAYS.items():
        rel = SWEEP_PAYS[c][3] if c <= 4 else none
        assert rows[str(c)]["released configuration"] == f"{rel:.1f} ({rel / none:.2f}×)"
        assert rows[str(c)]["K served"] == ("3" if c <= 4 else "off")
    assert rows["1"]["released configuration measured as"] == "fixed K=3"
    speed = section(md, "## Speed vs concurrency")
    assert "**Speculation pays up to 4 concurrent users on this hardware." in speed
    assert "vLLM served the schedule itself in the A/B; the release serves fixed K=3 up to 4 users" in speed
    rel = ctx["raw"]["speed"]["released"]
    assert (rel["kind"], rel["k"], rel["serve_limit"], rel["ranges"]) == ("fixed", 3, 4, [[1, 4, 3], [5, 1024, 0]])
    assert plot_speed(AbLiveResult.of(ab), tmp_path / "p.png").is_file()


def test_speculation_that_pays_nowhere_serves_the_target_without_it(tmp_path):
    ab = ab_with_schedule(NOWHERE, SWEEP_NOWHERE, served=False, t1={"greedy": T1_SLOW})
    sched = ab["schedule"]
    assert sched["speculative_config"] is None and sched["pays_up_to"] == 0
    ctx, md = _card(_inputs(tmp_path, ab))
    plain, risky = serve_lines(md)
    assert plain[:3] == ["vllm", "serve", "$TARGET"] and spec_of(plain) is None
    assert risky[2] == "served" and spec_of(risky) == {"method": "mtp", "num_speculative_tokens": 4}
    assert ctx["usage"]["speculative_config_json"] is None
    usage = section(md, "## Usage")
    assert "serve the target without\n`--speculative-config`. To load the drafter anyway, at your own risk:" in usage
    speed = section(md, "## Speed vs concurrency")
    assert "**Speculation pays at no measured concurrency on this hardware: serve without it.**" in speed
    assert "Schedule: speculation off at every batch size. The released configuration's numbers are no speculation's." in speed
    rows = speed_rows(md)
    assert all(r["K served"] == "off" and r["released configuration"].endswith("(1.00×)") for r in rows.values())
    (advice,) = section(md, "### Sampling (T > 0)").strip().splitlines()
    assert advice.startswith("- At T=1, keep speculation off on this hardware: no draft sampling method beats no "
                             "speculation by more than 2% at 1 concurrent user (the fine-tuned drafter at the fixed "
                             "K=4, × no speculation at 1, 2, 4, 8 users: greedy drafts 0.95× at 1")


# --------------------------------------------------------------------------- the release folder


def test_the_release_folder_has_the_plot_and_release_json_the_schedule(tmp_path):
    from safetensors.numpy import save_file

    from drafter.release.folder import ReleaseRecord, build_release_folder
    import numpy as np

    ab = ab_with_schedule(PAYS, SWEEP_PAYS, served=True, t1={"probabilistic": T1_PROB})
    inputs = _inputs(tmp_path, ab)
    (tmp_path / "train").mkdir()
    save_file({"mtp.w": np.zeros((2, 2), dtype=np.float32)}, str(tmp_path / "train" / "mtp-trained.safetensors"))
    inputs["train"] = Artifact("train", "t" * 16, tmp_path / "train", {})
    out = tmp_path / "release"
    res = build_release_folder(ReleaseConfig(), inputs, out, version="0.1.0", git_commit=None, repo_id="org/tiny-mtp")
    assert SPEED_PLOT in {f["path"] for f in res["files"]}
    png = (out / SPEED_PLOT).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    md = (out / "README.md").read_text()
    assert f"![tok/s vs concurrent users]({SPEED_PLOT})" in section(md, "## Speed vs concurrency")
    files = {r["file"].strip("`"): r for r in table(section(md, "## Files"))}
    assert files[SPEED_PLOT]["what it is"].startswith("plot: live tok/s vs concurrent users")
    rel = json.loads((out / "release.json").read_text())
    assert rel["schedule"] == json.loads(json.dumps(ab["schedule"]))
    assert SPEED_PLOT in {f["path"] for f in rel["files"]}
    assert ReleaseRecord.load(out).schedule.ranges == [[1, 4, 3], [5, 1024, 0]]
    assert rel["metrics"]["speed"]["by_concurrency"]["1"]["released"] == pytest.approx(SCHEDULE_TOK[1])


# --------------------------------------------------------------------------- an A/B without a sweep


def test_the_demo_ab_live_json_without_a_schedule_renders_the_fixed_k(tmp_path):
    """A real older ab_live.json (no ``schedule``): the fixed K's JSON, its numbers as the released configuration,
    the T=1 advice from its measurements, a plot; release.json's schedule is null."""
    inputs = {"ab_live": Artifact("ab_live", "d" * 16, DEMO / "ab_live", {})}
    ctx, md = _card(inputs)
    (argv,) = serve_lines(md)
    assert argv[2] == "served" and spec_of(argv) == {"method": "mtp", "num_speculative_tokens": 2}
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'""" in section(md, "## Usage")
    assert "K=2 is the K the live A/B served." in section(md, "## Usage")
    doc = json.loads((DEMO / "ab_live" / "ab_live.json").read_text())
    rows = speed_rows(md)
    assert list(rows) == ["1", "8"]
    for c, r in rows.items():
        none, cand = doc["summary"][f"t0/none/none/c{c}"]["tok_s"], doc["summary"][f"t0/candidate/greedy/c{c}"]["tok_s"]
        assert r["no speculation"] == f"{none:.1f}"
        assert r["fine-tuned, K=2"] == r["released configuration"] == f"{cand:.1f} ({cand / none:.2f}×)"
        assert r["K served"] == "2" and r["released configuration measured as"] == "fixed K=2"
    speed = section(md, "## Speed vs concurrency")
    assert "This A/B predates the concurrency sweep, so no schedule was derived" in speed
    assert "Speculation pays" in speed and "The sweep behind it" not in speed
    (advice,) = section(md, "### Sampling (T > 0)").strip().splitlines()
    assert advice.startswith("- At T=1, ") and "greedy drafts" in advice and "probabilistic drafts" in advice
    assert ctx["raw"]["speed"]["schedule"] is None
    assert plot_speed(AbLiveResult.load(DEMO / "ab_live"), tmp_path / "p.png").is_file()


def test_no_live_ab_keeps_the_fixed_k_and_says_not_measured():
    _, md = _card({})
    (argv,) = serve_lines(md)
    assert spec_of(argv) == {"method": "mtp", "num_speculative_tokens": ReleaseConfig().ab_live.num_speculative_tokens}
    assert "not measured: the ab_live stage did not run" in section(md, "## Speed vs concurrency")


def test_ranges_text():
    assert ranges_text([[1, 1, 2], [2, 1024, 0]]) == "1 request: K=2; 2–1024 requests: off"
    assert ranges_text([[1, 8, 3], [9, 9, 1], [10, 1024, 0]]) == "1–8 requests: K=3; 9 requests: K=1; 10–1024 requests: off"
