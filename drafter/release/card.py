"""The model card of a drafter release: every number read from a stage output, never typed.

:func:`card_context` reads the finished stage outputs (``inputs``: stage name → :class:`Artifact`)
and returns the template context: display strings (at the precision the card shows) and, under
``"raw"``, the same values unformatted (what ``release.json`` records). A stage that is absent or
was skipped gives ``"not measured: <why>"`` wherever its numbers would be. :func:`render_card`
renders ``model_card_templates/<kind>.md`` (after the shared macros of ``_macros.md``) through
:meth:`huggingface_hub.ModelCard.from_template` with a :class:`~huggingface_hub.ModelCardData`
front matter (``model-index`` with acceptance-length :class:`~huggingface_hub.EvalResult` entries).

Example::

    ctx = card_context(cfg, inputs, files=files, repo_id="org/tiny-mtp", version="0.1.0", git_commit=None)
    card = render_card(ctx, kind="mtp")
    card.save(out / "README.md")
"""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

from drafter.core.stage import Artifact, canonical_json
from drafter.evaluation.ab_live import AbLiveResult
from drafter.evaluation.offline_result import OfflineResult
from drafter.release.card_sections import (NOT_MEASURED, dspark_section, eagle3_section, gate_section, live_section,
                                           offline_section, quant_section, read_result, served_k, stage_reason,
                                           target_section, training_section)
from drafter.release.card_speed import SPEED_PLOT, speed_section, usage_spec
from drafter.release.redact import redact_local, redact_obj

TEMPLATES = Path(__file__).resolve().parents[2] / "model_card_templates"
MACROS = "_macros.md"
UNKNOWN_REPO = "ORG/NAME"
REQUIRED = ("prepare_target", "train", "gate")
KIND_TAGS = {"eagle3": ("eagle3", "speculators")}  # front matter tags after speculative-decoding, draft-model


def drafter_kind(cfg) -> str:
    """The kind of drafter a release trains (and the card template it gets): ``eagle3``, ``dspark`` or ``mtp``."""
    return "eagle3" if cfg.eagle3.enabled else "dspark" if cfg.dspark.enabled else "mtp"


def _eagle3_what(target: dict, train: dict, e: dict) -> str:
    if not e["ok"]:
        return e["reason"]
    return (f"An EAGLE-3 head for {target['name']} (vLLM's `method: eagle3`): one Llama decoder layer over "
            f"`fc`(the concatenation of the target's aux hidden states at layers {e['aux_layer_ids']}), with its own "
            f"draft vocabulary of {e['draft_vocab_size']:,} of the target's {e['vocab_size']:,} tokens (`d2t` / `t2d` "
            f"maps), trained with the training-time test over K={train['k']} steps; fine-tuned from {train['init']} "
            f"with the `{train['loss']}` loss ({train['trainable']:,} trainable parameters). The embedding is the "
            "target's (not in this release: vLLM shares it).")


def _summary(target, train, offline, k, dspark: dict | None = None, eagle3: dict | None = None) -> dict:
    if not train["ok"]:
        return {"what": train["reason"], "headline": offline.get("reason") or train["reason"]}
    if eagle3:
        what = _eagle3_what(target, train, eagle3)
    elif dspark:
        what = (f"A DSpark block drafter for {target['name']} (vLLM's `method: dspark`): {dspark['layers']} decoder "
                f"layer(s) over the target's layers {dspark['target_layer_ids']}, blocks of {dspark['block_size']} "
                f"tokens, a Markov head of rank {dspark['markov_rank']}"
                + (", a confidence head" if dspark["confidence_head"] else "")
                + f"; fine-tuned from {train['init']} with the `{train['loss']}` loss ({train['trainable']:,} "
                "trainable parameters). The embedding and the output head are the target's (not in this release).")
    else:
        what = (f"The MTP drafter of {target['name']}, fine-tuned from {train['init']} with the `{train['loss']}` loss "
                f"({train['trainable']:,} trainable parameters); frozen: {train['frozen']} "
                f"({train['frozen_params']:,} parameters, bytes identical to the release).")
    if offline["ok"] and offline["k_in_range"] and offline["served"]:
        s = offline["served"][0]
        headline = (f"Offline held-out τ at K={k}, {s['rule']}: {offline['baseline_name']} {s['released']} → "
                    f"fine-tuned {s['finetuned']} "
                    f"(Δ {s['delta']}, {offline['confidence']:.0%} CI {s['delta_ci']}, bootstrap over "
                    f"{offline['bootstrap_unit']}s).")
    else:
        headline = offline.get("reason_k") or offline.get("reason")
    return {"what": what, "headline": headline}


def _eval_results(offline: dict, ev: OfflineResult | None, model_name: str) -> list:
    from huggingface_hub import EvalResult

    if ev is None or not offline.get("ok") or not offline["k_in_range"]:
        return []
    k, d = offline["k"], ev.drafters["candidate"]
    files = offline["heldout_files"]
    dataset = f"user held-out files {', '.join(files)}" if files else "held-out split (regenerated)"
    out = []
    marks = {b["name"]: b for b in (ev.heldout.benchmarks if ev.heldout else [])}
    for rule, label in (("t0", "T=0"), ("t1_greedy", "T=1")):
        if rule not in d:
            continue
        for name, b in marks.items():  # one result per benchmark, the data set as the Hub names it
            if (s := d[rule].by_domain.get(name)) is not None:
                out.append(EvalResult(
                    task_type="text-generation", task_name="Speculative decoding (draft acceptance)",
                    dataset_type=b["hub_dataset"], dataset_name=b["title"], dataset_split="test",
                    metric_type="acceptance_length", metric_name=f"Acceptance length τ (K={k}, {label}, {b['title']})",
                    metric_config=f"k{k}-{rule}-{name}", metric_value=round(s.tau_by_k[k - 1], 3), verified=False))
        doms = [("all", d[rule])] + sorted((n, s) for n, s in d[rule].by_domain.items() if n not in marks)
        for dom, s in doms:
            out.append(EvalResult(
                task_type="text-generation", task_name="Speculative decoding (draft acceptance)",
                dataset_type="held-out", dataset_name=dataset, dataset_config=dom,
                dataset_split="heldout", metric_type="acceptance_length",
                metric_name=f"Acceptance length τ (K={k}, {label}, {dom})", metric_config=f"k{k}-{rule}-{dom}",
                metric_value=round(s.tau_by_k[k - 1], 3), verified=False))
    return out


def config_dump(cfg) -> dict:
    """The config as each section's ``key_dump`` (operational fields and secrets left out), local paths redacted."""
    out = {}
    for name in type(cfg).model_fields:
        v = getattr(cfg, name)
        out[name] = v.key_dump() if hasattr(v, "key_dump") else v
    return redact_obj(json.loads(json.dumps(out, default=str)))


def _forced_warning(gate: dict) -> str | None:
    if not gate.get("forced"):
        return None
    return ("FORCED RELEASE: the release gate refused this drafter"
            + (f" (failed checks: {', '.join(gate['failed'])})" if gate.get("failed") else "")
            + " and it was published only because `gate.force` was set. Do not assume it is better "
            "than the released drafter.")


def _limitations(offline: dict, live: dict, quant: dict, target: dict, kind: str, forced: bool) -> list[str]:
    out = []
    if offline.get("ok"):
        out.append(f"Offline τ comes from {offline['positions']} positions in {offline['windows']} windows of "
                   f"{offline['conversations']} held-out conversations ({offline['heldout']}); intervals are "
                   "bootstrap intervals over conversations and are wide when there are few of them.")
    if live.get("ok"):
        out.append(f"Live numbers were measured with vLLM {live['engine_version']}, {live['eager']}, over "
                   f"{live['turns']} replayed turns (hardware: {live['hardware']}); other hardware, batch sizes "
                   "and prompt mixes give other speeds.")
    else:
        out.append(f"Live A/B: {live['reason']}.")
    if not quant["exl3"]["ok"]:
        out.append(f"EXL3 form: {quant['exl3']['reason']}.")
    if quant["fp8"].get("verify", {}).get("ok") and str(quant["fp8"]["verify"]["vllm_load"]).startswith("unsupported"):
        out.append("The FP8 drop-in was verified byte-wise, but vLLM could not run FP8 on the machine that "
                   "built this release: " + quant["fp8"]["verify"]["vllm_load"])
    if target["source"] == "embedded":
        stand_in = {"dspark": "DSpark draft"}.get(kind, "drafter")
        what = ("served as the Llama it is, with a stand-in released EAGLE-3 head trained from scratch"
                if kind == "eagle3" else f"re-expressed with an MTP layer and a stand-in released {stand_in}")
        out.append(f"The target is the pipeline's embedded demo (a small model {what}): the numbers show the "
                   "pipeline working, not a production drafter's quality.")
    if forced:
        out.append("The release gate did not pass (see the gate section).")
    return out


def _usage(cfg, repo: str, target: dict, k: int, train: dict, live: dict, ab: AbLiveResult | None,
           kind: str) -> dict:
    """How to serve the release: the drafter file, K, the method, the ``--speculative-config`` JSON (the A/B's
    schedule, else the fixed K: :func:`~drafter.release.card_speed.usage_spec`; an EAGLE-3 head is loaded from the
    release repo, ``"model": <repo>``) and the server arguments the A/B ran with."""
    from drafter.models import TRAINED_NAME
    from drafter.models.dspark import DSPARK_DIR

    method = kind if kind != "mtp" else ((ab.method if ab else None) or cfg.ab_live.method)
    drafter_file = {"dspark": DSPARK_DIR, "eagle3": "model.safetensors"}.get(kind, TRAINED_NAME)
    return {"repo_id": repo, "target_short": target["short"], "target_how": target["how"],
            "drafter_file": drafter_file, "k": k,
            "draft_vocab": (train.get("draft_vocab") or {}).get("size") if train.get("ok") and kind == "mtp" else None,
            "method": method, **usage_spec(ab, method, k, dspark=kind == "dspark",
                                           model=repo if kind == "eagle3" else None),
            "server_args": live["server_args"] if live.get("ok") else shlex.join(
                ["--dtype", cfg.serving.dtype, "--max-model-len", str(cfg.serving.max_model_len)]
                + (["--enforce-eager"] if cfg.ab_live.eager(cfg.serving) else [])
                + [redact_local(a) for a in cfg.ab_live.server_args])}


def _raw(inputs, offline: dict, live: dict, quant: dict, train: dict, gate: dict, speed: dict) -> dict:
    """The unformatted values (what ``release.json`` records as its metrics) and why a stage's are missing."""
    return {"offline": offline.get("raw"), "live": live.get("raw"), "speed": speed.get("raw"),
            "fp8": {**(quant["fp8"].get("raw") or {}), "verify": quant["fp8"].get("verify")},
            "exl3": quant["exl3"].get("raw") or quant["exl3"].get("reason"),
            "training": train.get("raw"), "gate": gate.get("raw"),
            "reasons": {s: stage_reason(inputs, s) for s in
                        ("prepare_target", "generate", "scrub", "capture", "bootstrap_drafter", "train",
                         "eval_offline", "quantize_fp8", "verify_fp8", "quantize_exl3", "ab_live", "gate")
                        if stage_reason(inputs, s)}}


def card_context(cfg, inputs: dict[str, Artifact], *, files: list[dict], repo_id: str | None, version: str,
                 git_commit: str | None) -> dict:
    """Everything the card shows, read from the stage outputs (see the module docstring). The kind of
    drafter (:func:`drafter_kind`: ``mtp``, ``dspark`` with ``dspark.enabled``, ``eagle3`` with ``eagle3.enabled``)
    picks the template."""
    kind = drafter_kind(cfg)
    ab, ab_why = read_result(inputs, "ab_live", AbLiveResult)
    ev, ev_why = read_result(inputs, "eval_offline", OfflineResult)
    repo = repo_id or UNKNOWN_REPO
    eagle3 = eagle3_section(cfg, inputs, ev) if kind == "eagle3" else None
    if kind == "dspark" and not ab:
        k = cfg.dspark.block_size
    elif kind == "eagle3" and not ab:  # the K its speculators config serves (the train output), else the config's
        k = (eagle3.get("speculative_tokens") if eagle3["ok"] else None) or cfg.eagle3.speculative_tokens
    else:
        k = served_k(cfg, ab)
    target = target_section(cfg, inputs)
    offline = offline_section(cfg, inputs, k, ev, ev_why)
    live = live_section(cfg, inputs, ab, ab_why, ev)
    speed = speed_section(cfg, inputs, ab, ab_why, plot=any(f.get("path") == SPEED_PLOT for f in files),
                          model=repo if kind == "eagle3" else None)
    quant = quant_section(inputs)
    train = training_section(cfg, inputs, kind)
    dspark = dspark_section(cfg, inputs, ev) if kind == "dspark" else None
    gate = gate_section(inputs)
    conf = config_dump(cfg)
    config_hash = hashlib.sha256(canonical_json(conf).encode()).hexdigest()[:16]
    keys = {name: a.key for name, a in sorted(inputs.items())}
    model_name = repo.rsplit("/", 1)[-1] if repo_id else (cfg.name if kind in cfg.name.lower() else f"{cfg.name}-{kind}")
    forced_warning = _forced_warning(gate)
    ctx = {
        "name": cfg.name, "kind": kind, "repo_id": repo, "model_name": model_name, "version": version,
        "git_commit": git_commit or f"{NOT_MEASURED}: not built from a git checkout",
        "forced_warning": forced_warning, "target": target, "k": k, "dspark": dspark, "eagle3": eagle3,
        "summary": _summary(target, train, offline, k, dspark, eagle3),
        "files": files, "offline": offline, "live": live, "speed": speed, "quant": quant, "training": train,
        "gate": gate,
        "usage": _usage(cfg, repo, target, k, train, live, ab, kind),
        "provenance": {"config_hash": config_hash, "stage_keys": keys, "version": version,
                       "git_commit": git_commit or f"{NOT_MEASURED}: not built from a git checkout",
                       "target_revision": target["revision"], "chat_template_sha256": target["chat_template_sha256"]},
        "limitations": _limitations(offline, live, quant, target, kind, bool(forced_warning)),
        "front": {"license": target["license"], "base_model": target["base_model"],
                  "tags": list(dict.fromkeys(["speculative-decoding", "draft-model", *KIND_TAGS.get(kind, (kind,)),
                                              "vllm", *cfg.publish.tags])),
                  "datasets": list(cfg.publish.datasets) or None},
        "config": conf,
    }
    ctx["raw"] = _raw(inputs, offline, live, quant, train, gate, speed)
    if eagle3 is not None:
        ctx["raw"]["eagle3"] = eagle3.get("raw") or eagle3.get("reason")
    ctx["eval_results"] = _eval_results(offline, ev, model_name)
    return redact_obj_keep(ctx)


def redact_obj_keep(ctx: dict) -> dict:
    """Redact strings of the context but keep non-JSON objects (EvalResult) as they are."""
    out = {}
    for k, v in ctx.items():
        out[k] = v if k == "eval_results" else redact_obj(v)
    return out


def required_missing(inputs: dict[str, Artifact]) -> list[str]:
    """Results the card requires that are missing or skipped: the publish stage refuses to publish then."""
    out = []
    for s in REQUIRED:
        why = stage_reason(inputs, s)
        if why:
            out.append(f"{s}: {why}")
    return out


def render_card(context: dict, kind: str = "mtp"):
    """The card (``huggingface_hub.ModelCard``) of ``kind`` rendered from ``model_card_templates/``."""
    from huggingface_hub import ModelCard, ModelCardData

    path = TEMPLATES / f"{kind}.md"
    if not path.is_file():
        kinds = sorted(p.stem for p in TEMPLATES.glob("*.md") if not p.name.startswith("_"))
        raise ValueError(f"no model card template for drafter kind {kind!r} ({path}); templates exist for {kinds}")
    f = context["front"]
    data = ModelCardData(
        license=f["license"], base_model=f["base_model"], base_model_relation="adapter" if f["base_model"] else None,
        library_name="vllm", pipeline_tag="text-generation", tags=f["tags"], datasets=f["datasets"],
        model_name=context["model_name"], eval_results=context["eval_results"] or None,
    )
    # jinja2.Template (what from_template uses) has no loader: the shared macros are prepended as text
    template = (TEMPLATES / MACROS).read_text(encoding="utf-8") + path.read_text(encoding="utf-8")
    ctx = {k: v for k, v in context.items() if k not in ("eval_results",)}
    return ModelCard.from_template(data, template_str=template, **ctx)
