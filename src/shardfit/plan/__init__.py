"""Plan: per-GPU memory of every strategy before anything is loaded, and the choice that fits."""
