"""`shardfit doctor`: prove the ranks of a launch can talk, time their links, and name the environment traps."""
