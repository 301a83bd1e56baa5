"""Parallel: process-group setup, launching under torchrun, and wrapping a model for a strategy."""
