"""Using a trained model: load a run (LoRA without merging, a merged or fully fine-tuned folder), generate, chat."""
