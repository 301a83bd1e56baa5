from shardfit.cli.main import main

raise SystemExit(main())
