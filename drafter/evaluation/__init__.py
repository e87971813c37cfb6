"""Evaluation: acceptance rules, offline τ, the live A/B in vLLM, the release gate and the run report."""
