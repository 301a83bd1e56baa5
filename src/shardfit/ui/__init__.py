"""`shardfit ui`: a small local web UI (standard library HTTP server, plain HTML forms, no script): the plan
calculator, launching a run from a config, and the runs' live reports."""
