from shardfit.cli.main import entry

raise SystemExit(entry())
