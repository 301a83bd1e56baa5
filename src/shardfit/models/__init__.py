"""Models: find weights (HF folder, GGUF, bundled), load them for a strategy, and set up what trains."""
