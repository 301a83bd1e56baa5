"""Simulate: `plan --simulate`, a training step on fake tensors measured by torch's memory trackers."""
