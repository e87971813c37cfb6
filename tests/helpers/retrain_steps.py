"""Run the `retrain` flow (drafter_prefect/retrain.py) directly, step after step, in ONE process against the
Prefect server of $PREFECT_API_URL — the flow's decisions below the worker (tests/test_deployments.py runs
one nightly retrain through a real process worker; the others go through this script, paying Prefect's
and torch's import once).

    python -m tests.helpers.retrain_steps PLAN.json OUT.jsonl

PLAN.json: ``{"config": {...}, "traffic": ["glob", ...], "repo_id": "org/name" | null, "steps": [
{"name": ..., "files": {path: [row, ...]}, "overrides": [...]}, ...]}``. Each step first writes its traffic
files (JSON lines), then runs the flow; one line per step goes to OUT.jsonl: the step's name, the flow
run's id and state, the flow's result, the run summaries in the (local) store and, with ``repo_id``, the Hub's commits of that repo after the step
(newest first; endpoint and token from the config's ``publish`` section and $HF_TOKEN)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _commits(repo_id: str, endpoint: str) -> list[str]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return [c.commit_id for c in HfApi(endpoint=endpoint, token=os.environ["HF_TOKEN"]).list_repo_commits(repo_id)]
    except RepositoryNotFoundError:
        return []


def main(plan_path: str, out_path: str) -> None:
    from drafter_prefect.retrain import retrain

    plan = json.loads(Path(plan_path).read_text())
    with open(out_path, "a") as out:
        for step in plan["steps"]:
            for f, rows in step.get("files", {}).items():
                Path(f).write_text("".join(json.dumps(r) + "\n" for r in rows))
            state = retrain(config=plan["config"], traffic=plan["traffic"], overrides=step.get("overrides", []),
                            return_state=True)
            line = {"name": step["name"], "flow_run_id": str(state.state_details.flow_run_id), "state": state.type.value,
                    "result": state.result(raise_on_failure=False) if state.is_completed() else repr(state.message)}
            line["runs"] = sorted(p.name for p in (Path(plan["config"]["store"]["root"]) / "runs").glob("*.json"))
            if plan.get("repo_id"):
                line["commits"] = _commits(plan["repo_id"], plan["config"]["publish"]["endpoint"])
            out.write(json.dumps(line, default=str) + "\n")
            out.flush()
            if not state.is_completed():
                sys.exit(f"step {step['name']}: the flow run ended {state.type.value}: {state.message}")


if __name__ == "__main__":
    main(*sys.argv[1:])
