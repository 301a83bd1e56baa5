"""The `shardfit` command line."""
