"""Planning estimators: pure functions, no torch.distributed."""
