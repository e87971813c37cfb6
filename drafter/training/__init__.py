"""Training: losses and the training loop (one run as a stage needs it in :mod:`drafter.training.run`)."""
