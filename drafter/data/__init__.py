"""Data: checks of the run's inputs (preflight), prompts, regeneration with the served target, secret scrubbing, feature capture, training windows."""
