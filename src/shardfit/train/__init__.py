"""Train: the loss, the optimizer and schedule, checkpoints, metrics, export, and the loop that ties them."""
