"""Training: state, optimizer, the step, evaluation, sampling, checkpoints, metrics and the loop."""
