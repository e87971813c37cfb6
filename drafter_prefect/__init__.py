"""The orchestration of drafter-release: the only package that imports Prefect.

* :mod:`drafter_prefect.release` — the end-to-end flow (``drafter release``, the ``release`` deployments);
* :mod:`drafter_prefect.retrain` — the scheduled champion/challenger flow;
* :mod:`drafter_prefect.stages` — one flow per stage, for per-stage deployments (GPU pools, containers);
* :mod:`drafter_prefect.task` — the Prefect task around a stage (cache key = stage key, retries, artifacts);
* :mod:`drafter_prefect.containers` — ``runner: containers``: each stage a flow run of its deployment;
* :mod:`drafter_prefect.events` — events for automations (deployments/automations.yaml);
* :mod:`drafter_prefect.api_server` — the local Prefect API server ``drafter release`` starts when
  ``PREFECT_API_URL`` is not set, and its signal handling.

``flows/`` holds the entry points ``deployments/prefect.yaml`` names; the library (``drafter/``) never imports
this package, except the command line's ``release``/``publish`` commands, which run the flow.
"""
