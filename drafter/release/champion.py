"""Champion / challenger: a retrain publishes its candidate only if it beats the last release.

The **champion** is the last release of this release name — read from the Hub (the branch head's
``release.json`` and drafter file) when publishing is on, else from the store (the newest completed
run whose ``publish`` stage finished: its release folder). Its drafter file is checked against the
sha256 its ``release.json`` records and copied to the local cache under its release id.

The **challenge** runs the usual stages with the champion as the baseline (``baseline.*``): both
drafters are measured on the same held-out set (eval_offline) and the same replayed traffic
(ab_live). The candidate wins only if

* the gate's checks pass against the champion (:func:`drafter.evaluation.gate.gate_decision`; with
  ``gate.force`` and no live A/B this check is waived, and the decision says so), and
* its offline held-out τ (T=0, at the served K) exceeds the champion's by more than
  ``retrain.min_tau_gain`` — never waived: a retrain never publishes a drafter that is not better, and
* at every concurrency the A/B measured, the candidate's released configuration (its schedule or fixed K, see
  :func:`drafter.evaluation.ab_live.sweep.released_configuration`) is not slower than the champion's:
  tok/s ≥ the champion's · (1 − ``gate.tok_s_tolerance``) (:func:`speed_comparison`; waived without a live A/B).

The champion's speed at concurrency c is its own released configuration's K there (its ``release.json``
``released.ranges``, else ``schedule.ranges``; a release without either: the served K), read from this run's measurements: K = 0 → no speculation's tok/s;
the served K → the baseline's tok/s; another K (the baseline is measured at the served K only) → the baseline's
tok/s at the served K, and the row's note says so.

Example::

    champ = find_champion(cfg, store)                 # None before the first release
    cfg.baseline = baseline_for(champ, cfg.retrain)   # then run the stages up to ab_live
    d = challenge(ab_live_json, eval_offline_json, cfg, champ.release_id, champion_release=champ.release)
    d["winner"], d["reasons"], d["champion"]["tau_offline"], d["candidate"]["tau_offline"]
    d["speed"]   # [{"concurrency": 8, "candidate_tok_s": …, "champion_tok_s": …, "champion_k": 0, "ok": …, …}]
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from drafter.core.config import BaselineConfig, ReleaseConfig, RetrainConfig
from drafter.core.errors import StageError
from drafter.core.store import Store, sha256_file
from drafter.models.layouts import TRAINED_NAME
from drafter.evaluation.ab_live import NO_ENTRY, AbLiveResult, as_ab_live, primary, summary_of
from drafter.evaluation.ab_live.sweep import released_speeds
from drafter.evaluation.offline_result import OfflineResult
from drafter.release.folder import RELEASE_JSON, ReleaseFile, ReleaseRecord

KEPT = "champion kept"
REPLACED = "champion replaced"
FIRST = "first release"


@dataclass
class Champion:
    release_id: str
    source: str  # where it was read: "hub ORG/NAME@<commit>" or "store run <run id>"
    release: dict  # its release.json (:class:`~drafter.release.folder.ReleaseRecord` reads it)
    weights: Path  # a local, sha256-checked copy of its drafter file
    sha256: str


def _drafter_entry(release: ReleaseRecord, where: str) -> ReleaseFile:
    for f in release.files:
        if f.path == TRAINED_NAME:
            return f
    raise StageError(f"{where}: {RELEASE_JSON} lists no {TRAINED_NAME} (the drafter file); cannot use it as the "
                     "champion")


def _cached_copy(src: Path, sha256: str, release_id: str, cache_dir: Path, where: str) -> Path:
    """``src`` copied to ``cache_dir/champions/<release id>/`` after checking its sha256 (a path that names
    the content, so the stage keys that record it are stable)."""
    got = sha256_file(src)
    if got != sha256:
        raise StageError(f"{where}: {TRAINED_NAME} has sha256 {got}, its {RELEASE_JSON} says {sha256}: the "
                         "champion's files do not match its record")
    dst = Path(cache_dir).expanduser() / "champions" / release_id / TRAINED_NAME
    if not (dst.is_file() and sha256_file(dst) == sha256):
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name("." + dst.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
    return dst


def champion_from_store(store: Store, name: str, cache_dir: str | Path,
                        warn: Callable[[str], None] | None = None) -> Champion | None:
    """The newest completed run of release ``name`` whose ``publish`` stage finished (its release folder); None if none."""
    for run in reversed(store.runs(warn=warn)):
        if run.get("release") != name or run.get("status") != "completed":
            continue
        pub = next((s for s in run.get("stages", []) if s.get("stage") == "publish"
                    and s.get("status") in ("computed", "reused")), None)
        if pub is None:
            continue
        art = store.find("publish", pub["key"])
        where = f"store run {run['run_id']} (publish/{pub['key']})"
        if art is None:
            if warn:
                warn(f"champion: {where} is no longer in the store; looking at earlier runs")
            continue
        folder = Path(art.path) / "release"
        release = ReleaseRecord.load(folder)
        entry = _drafter_entry(release, where)
        w = _cached_copy(folder / TRAINED_NAME, entry.sha256, release.release_id, Path(cache_dir), where)
        return Champion(release.release_id, f"store run {run['run_id']}", release.raw, w, entry.sha256)
    return None


def champion_from_hub(cfg: ReleaseConfig, token: str, cache_dir: str | Path) -> Champion | None:
    """The release at the head of ``publish.branch`` of ``publish.repo_id``; None when the repo, the branch or
    its ``release.json`` does not exist yet. Hub errors: as the upload's (5xx retried by the flow, 4xx permanent)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    from drafter.release.hub import PublishError, _call, _Transient, endpoint_of

    pc = cfg.publish
    api = HfApi(endpoint=endpoint_of(pc), token=token)
    repo = pc.repo_id
    try:
        try:
            info = _call("reading the champion's branch head",
                         lambda: api.repo_info(repo, revision=pc.branch), repo_id=repo, token=token)
        except Exception as e:
            if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError)) or \
                    isinstance(e.__context__, (RepositoryNotFoundError, RevisionNotFoundError)) or "HTTP 404" in str(e):
                return None
            raise
        sha = info.sha
        dl_dir = Path(cache_dir).expanduser() / "champions" / "hub"

        def download(name: str) -> Path | None:
            try:
                return Path(_call(f"downloading {name}", lambda: api.hf_hub_download(
                    repo, name, revision=sha, cache_dir=str(dl_dir)), repo_id=repo, token=token))
            except Exception as e:
                if isinstance(e, EntryNotFoundError) or isinstance(e.__context__, EntryNotFoundError) \
                        or "HTTP 404" in str(e):
                    return None
                raise

        rel_path = download(RELEASE_JSON)
        if rel_path is None:
            return None
        release = ReleaseRecord.from_file(rel_path)
        where = f"hub {repo}@{sha[:12]}"
        entry = _drafter_entry(release, where)
        w = download(TRAINED_NAME)
        if w is None:
            raise StageError(f"{where}: {RELEASE_JSON} lists {TRAINED_NAME} but the repo has no such file")
        w = _cached_copy(w, entry.sha256, release.release_id, Path(cache_dir), where)
        return Champion(release.release_id, f"hub {repo}@{sha}", release.raw, w, entry.sha256)
    except _Transient as e:
        raise PublishError(f"reading the champion from {repo}: {e} (retry later)") from None


def find_champion(cfg: ReleaseConfig, store: Store, token: str | None = None,
                  warn: Callable[[str], None] | None = None) -> Champion | None:
    """The champion: from the Hub when publishing sends (``publish.dry_run`` false), else from the store."""
    if not cfg.publish.dry_run:
        from drafter.release.hub import read_token

        return champion_from_hub(cfg, token or read_token(cfg.publish), cfg.store.cache_dir)
    return champion_from_store(store, cfg.name, cfg.store.cache_dir, warn=warn)


def baseline_for(champ: Champion, rc: RetrainConfig) -> BaselineConfig:
    """The ``baseline`` section that makes a run compare with (and, by ``retrain.start_from``, start from) ``champ``."""
    return BaselineConfig(weights=str(champ.weights), sha256=champ.sha256, release_id=champ.release_id,
                          init=rc.start_from == "champion")


def _live(ab: AbLiveResult | None, who: str) -> dict[str, Any]:
    """Live τ and tok/s at 1 user of ``who`` at the A/B's primary measurement (lowest temperature, greedy drafts)."""
    if ab is None or not ab.summary:
        return {"tau_live": None, "tok_s_c1": None}
    t, m = primary(ab)
    s = summary_of(ab).get((t, who, m, 1), NO_ENTRY)
    return {"tau_live": s.tau, "tok_s_c1": s.tok_s}


def _gate(ab: AbLiveResult | None, ev: OfflineResult, cfg: ReleaseConfig, no_live_reason: str | None
          ) -> tuple[dict, bool, list[str]]:
    """The gate's decision against the champion (never forced), whether it counts as passed, and why not."""
    from drafter.evaluation.gate import gate_decision, gate_without_live

    gcfg = cfg.gate.model_copy(update={"force": False})
    g = gate_decision(ab, ev, gcfg) if ab is not None else gate_without_live(no_live_reason or "ab_live did not run", gcfg)
    reasons: list[str] = []
    gate_ok = g["verdict"] == "pass"
    if not gate_ok and ab is None and cfg.gate.force:
        gate_ok = True
        reasons.append(f"no live A/B ({no_live_reason}); gate.force waives the gate's live checks — the decision "
                       "rests on the offline comparison alone")
    elif not gate_ok:
        reasons += [f"gate check {c['name']} failed: {c['detail']}" for c in g["checks"] if not c["passed"]]
    return g, gate_ok, reasons


def _champion_schedule(release: dict | None) -> list[tuple[int, int, int]] | None:
    """The ranges ``[batch_from, batch_to, K]`` the champion serves: its ``release.json`` ``released`` (the schedule
    or a fixed K with a serve limit), else its ``schedule``; None when its release has neither (an older release)."""
    sched = (release or {}).get("released") or (release or {}).get("schedule")
    if sched is None:
        return None
    if hasattr(sched, "model_dump"):
        sched = sched.model_dump()
    try:
        return [(int(lo), int(hi), int(k)) for lo, hi, k in sched.get("ranges") or []]
    except (TypeError, ValueError, AttributeError):
        raise StageError(f"the champion's {RELEASE_JSON}: schedule.ranges must be [batch_from, batch_to, K] "
                         f"lists, got {sched.get('ranges') if isinstance(sched, dict) else sched!r}") from None


def _champion_k(ranges: list[tuple[int, int, int]] | None, c: int, k: int) -> tuple[int, str]:
    """The K the champion serves at ``c`` users and where it comes from."""
    if ranges is None:
        return k, f"fixed K={k} (its release has no schedule)"
    for lo, hi, kk in ranges:
        if lo <= c <= hi:
            return kk, f"its schedule: K={kk} for {lo}–{hi} users"
    return 0, f"its schedule has no range for {c} users: taken as no speculation"


def _users(c: int) -> str:
    return f"{c} user{'s' if c != 1 else ''}"


def speed_comparison(ab: AbLiveResult, k: int, champion_release: dict | None, tolerance: float) -> list[dict]:
    """Per measured concurrency: the candidate's released configuration's tok/s vs the champion's schedule's,
    both from this run's A/B (see the module docstring), and whether the candidate is not slower beyond
    ``tolerance``."""
    s, (t0, m0) = summary_of(ab), primary(ab)
    ranges = _champion_schedule(champion_release)
    rows = []
    for c, sp in released_speeds(ab).items():
        ck, where = _champion_k(ranges, c, k)
        if ck == 0:
            champ, note = s.get((t0, "none", "none", c), NO_ENTRY).tok_s, f"{where}: no speculation's tok/s this run"
        else:
            champ, note = s.get((t0, "baseline", m0, c), NO_ENTRY).tok_s, where
            if ck != k:
                note += f"; K={ck} was not measured for the champion this run: its K={k} tok/s stands in"
        thr = None if champ is None else round(champ * (1 - tolerance), 3)
        ok = sp.tok_s is not None and thr is not None and sp.tok_s >= thr
        if sp.tok_s is None or champ is None:
            note += "; not measured: " + " and ".join(w for w, v in (("candidate", sp.tok_s), ("champion", champ))
                                                      if v is None)
        rows.append({"concurrency": c, "candidate_tok_s": sp.tok_s, "candidate_k": k if sp.k is None else sp.k,
                     "candidate_source": sp.source, "champion_tok_s": champ, "champion_k": ck, "threshold": thr,
                     "ok": ok, "note": note})
    return rows


def _speed_reasons(rows: list[dict], tolerance: float) -> tuple[bool, list[str]]:
    """Whether the candidate is not slower than the champion anywhere, and the reason lines: one per concurrency
    where it is (or could not be compared), else one line listing them all."""
    def n(v):
        return "—" if v is None else f"{v:.1f}"

    if not rows:
        return False, ["tok/s: no concurrency measured with and without speculation; the schedules cannot be compared"]
    bad = [r for r in rows if not r["ok"]]
    if not bad:
        return True, [f"tok/s (tolerance {tolerance:.0%}): the candidate's released configuration is not slower than "
                      "the champion's schedule at any measured concurrency — " + ", ".join(
                          f"c{r['concurrency']} {n(r['candidate_tok_s'])} vs {n(r['champion_tok_s'])} "
                          f"(K={r['candidate_k']} vs K={r['champion_k']})" for r in rows)]
    return False, [f"tok/s at c{r['concurrency']} ({_users(r['concurrency'])}): candidate {n(r['candidate_tok_s'])} "
                   f"(K={r['candidate_k']}) vs champion {n(r['champion_tok_s'])} (K={r['champion_k']}, {r['note']}); "
                   f"must be ≥ {n(r['threshold'])}, tolerance {tolerance:.0%}" for r in bad]


def challenge(ab: AbLiveResult | dict | None, ev: OfflineResult | dict, cfg: ReleaseConfig,
              champion_id: str | None = None, no_live_reason: str | None = None, *,
              champion_release: dict | None = None) -> dict:
    """The decision of a challenge (``ev``: the run's eval_offline.json, its baseline the champion; ``ab``:
    its ab_live.json, None when ab_live was skipped for ``no_live_reason``; ``champion_release``: the champion's
    release.json, whose ``schedule`` the speed comparison reads — None: its fixed K, the served K).

    Returns ``{"winner": "candidate"|"champion", "decision", "reasons", "k", "min_tau_gain",
    "champion": {release_id, tau_offline, tau_live, tok_s_c1}, "candidate": {…}, "gate": {verdict, failed, checks},
    "speed": [{concurrency, candidate_tok_s, candidate_k, candidate_source, champion_tok_s, champion_k, threshold,
    ok, note}]}`` (``speed`` empty without a live A/B).
    """
    ab = as_ab_live(ab) if ab is not None else None
    ev = OfflineResult.of(ev)
    k = int(ab.num_speculative_tokens) if ab else cfg.ab_live.num_speculative_tokens
    g, gate_ok, reasons = _gate(ab, ev, cfg, no_live_reason)
    champ_tau, cand_tau = ev.tau("baseline", "t0", k), ev.tau("candidate", "t0", k)
    gain = cfg.retrain.min_tau_gain
    if champ_tau is None or cand_tau is None:
        tau_ok = False
        reasons.append(f"no offline τ at K={k} (eval_offline.k_max too small?)")
    else:
        tau_ok = cand_tau > champ_tau + gain
        rel = ">" if tau_ok else "≤"
        reasons.append(f"offline held-out τ (T=0, K={k}): candidate {cand_tau:.4f} {rel} champion {champ_tau:.4f}"
                       + (f" + min_tau_gain {gain}" if gain else ""))
    tol = cfg.gate.tok_s_tolerance
    if ab is None:
        speed: list[dict] = []
        speed_ok = True
        reasons.append(f"no live A/B ({no_live_reason or 'ab_live did not run'}): the tok/s comparison with the "
                       "champion's schedule is waived")
    else:
        speed = speed_comparison(ab, k, champion_release, tol)
        speed_ok, why = _speed_reasons(speed, tol)
        reasons += why
    winner = "candidate" if gate_ok and tau_ok and speed_ok else "champion"
    return {
        "winner": winner, "decision": REPLACED if winner == "candidate" else KEPT, "reasons": reasons,
        "k": k, "min_tau_gain": gain,
        "champion": {"release_id": champion_id, "tau_offline": champ_tau, **_live(ab, "baseline")},
        "candidate": {"tau_offline": cand_tau, **_live(ab, "candidate")},
        "gate": {"verdict": g["verdict"], "failed": g["failed"], "checks": g["checks"]},
        "speed": speed,
    }


def decision_markdown(name: str, d: dict, counts: str) -> str:
    """The ``retrain-decision`` artifact of a challenge: the verdict, why, and both sets of numbers."""
    def f(v, nd=3):
        return "—" if v is None else f"{v:.{nd}f}"

    c, n = d["champion"], d["candidate"]
    lines = [f"# Retrain {name}: {d['decision']}", "", counts, "",
             "| drafter | offline τ (T=0, K=%d) | live τ | tok/s at 1 user |" % d["k"], "|---|---|---|---|",
             f"| champion `{c['release_id']}` | {f(c['tau_offline'], 4)} | {f(c['tau_live'])} | {f(c['tok_s_c1'], 2)} |",
             f"| candidate | {f(n['tau_offline'], 4)} | {f(n['tau_live'])} | {f(n['tok_s_c1'], 2)} |", "",
             "Why:", ""] + [f"- {r}" for r in d["reasons"]]
    if d.get("speed"):
        lines += ["", "Tokens/s of the released configurations, this run's measurements:", "",
                  "| users | candidate tok/s (K) | champion tok/s (K) | not slower | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['concurrency']} | {f(r['candidate_tok_s'], 1)} ({r['candidate_k']}) | "
                  f"{f(r['champion_tok_s'], 1)} ({r['champion_k']}) | {'yes' if r['ok'] else '**no**'} | {r['note']} |"
                  for r in d["speed"]]
    return "\n".join(lines) + "\n"
