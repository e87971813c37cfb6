"""`scrub` stage: remove secrets from the generated conversations before anything trains on them.

Inputs: the `generate` stage's ``shards/shard-*.jsonl`` (one conversation per row).
Computes: every string of every row (messages and provenance, not the row's id/split/domain/
mode) with private keys, API keys, tokens, URL passwords, password assignments and e-mails
replaced (kinds and extra patterns from ``cfg.scrub``; see :mod:`drafter.data.scrub`). A changed row
loses its token-id fields (they would decode back to the secret).
The user's own secrets never reach this stage: `generate` scrubs user conversations with the same
rules before generating (and reports them as ``input_secrets``); this stage removes what the model
wrote (it may invent secret-like strings) and adds generate's input counts to its own, so its
totals per kind cover both.
Writes: ``shards/shard-*.jsonl`` (same shard names and row format, plus ``scrubbed: {kind:
count}`` per row: what this stage found) and ``report.json`` (``counts``: totals per kind, input +
generated; ``counts_generated``: found here; ``counts_input``: found by generate in the user's
conversations; per shard; never the secrets).
Reports: ``rows``, ``rows_changed``, ``secrets`` and ``secrets_<kind>`` for every kind (input +
generated), ``secrets_generated``, ``secrets_input``.
Resumes: shards already written to ``out`` on an earlier try are kept.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.files import iter_jsonl, list_shards, read_jsonl, remove_partial_files, write_jsonl_atomic
from drafter.core.errors import StageError
from drafter.core.progress import progress
from drafter.data.reports import ScrubReport, secrets_removed_by_generate
from drafter.data.scrub import scrub_row, scrubber_for
from drafter.core.stage import Artifact, Metrics, Stage


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    sc = cfg.scrub
    scrubber = scrubber_for(sc)
    src_dir = inputs["generate"].path / "shards"
    shards = list_shards(src_dir)
    if not shards:
        raise StageError(f"generate output {src_dir} has no shard-*.jsonl files")
    out_dir = out / "shards"
    remove_partial_files(out)

    totals: Counter = Counter()
    per_shard = []
    rows = rows_changed = reused = 0
    with progress("scrub", total=len(shards), unit="shards") as bar:
        for src in shards:
            dst = out_dir / src.name
            if dst.exists():  # finished on an earlier try (written atomically)
                done = read_jsonl(dst)
                counts = Counter()
                for r in done:
                    counts.update(r.get("scrubbed", {}))
                changed = sum(1 for r in done if r.get("scrubbed"))
                reused += 1
            else:
                done, counts, changed = [], Counter(), 0
                for row in iter_jsonl(src):
                    if "messages" not in row:
                        raise StageError(f"{src}: row {row.get('id', '?')!r} has no 'messages'")  # ids are scrubbed by generate
                    new, c = scrub_row(row, scrubber)
                    done.append(new)
                    counts.update(c)
                    changed += bool(c)
                write_jsonl_atomic(dst, done)
            per_shard.append({"shard": src.name, "rows": len(done), "rows_changed": changed, "counts": dict(counts)})
            totals.update(counts)
            rows += len(done)
            rows_changed += changed
            bar.advance(1)

    kinds = scrubber.all_kinds
    counts_input = secrets_removed_by_generate(inputs["generate"].path, kinds)
    counts_generated = {k: totals.get(k, 0) for k in kinds}
    counts_all = {k: counts_generated[k] + counts_input[k] for k in kinds}
    ScrubReport.write(out, {
        "kinds": kinds,
        "replacement": sc.replacement,
        "rows": rows,
        "rows_changed": rows_changed,
        "counts": counts_all,
        "counts_generated": counts_generated,
        "counts_input": counts_input,
        "shards": per_shard,
    })
    metrics: Metrics = {"rows": rows, "rows_changed": rows_changed, "secrets": sum(counts_all.values()),
                        "secrets_generated": sum(counts_generated.values()), "secrets_input": sum(counts_input.values()),
                        "shards": len(shards), "shards_reused": reused}
    metrics.update({f"secrets_{k}": v for k, v in counts_all.items()})
    return metrics


STAGE = Stage(
    name="scrub",
    version="2",  # 2: totals include generate's input counts (the report's counts_generated / counts_input)
    inputs=("generate",),
    sections=("scrub",),
    run=run,
    description="Remove secrets (keys, tokens, passwords, e-mails) from the conversations",
)
