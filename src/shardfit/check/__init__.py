"""Check: preflight rules on the model as the strategy would place it; fixes what is safe to fix."""
