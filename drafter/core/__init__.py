"""Core: configuration, the store, the stage contract and registry, the pipeline runner, errors, progress, files, child processes."""
