"""`shardfit report`: a run's (or several runs') curves, memory per rank against the plan, config, plan, summary
and preflight findings as one self-contained HTML page and PNGs. Reads the run directory only: no torch."""
