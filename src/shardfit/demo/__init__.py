"""The built-in demo: SmolLM2-135M-Instruct learns a fixed record format with LoRA, before/after accuracy."""
