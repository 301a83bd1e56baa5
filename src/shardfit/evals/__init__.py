"""Generation metrics users choose (exact, contains, regex, their own Python scorer), scored on held-out prompts;
used by `shardfit eval` and by training's evaluations (`eval_metrics`)."""
