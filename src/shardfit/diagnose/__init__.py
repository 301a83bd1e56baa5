"""Diagnose: match a pasted log against known causes (causes.yaml) and explain the best matches."""
