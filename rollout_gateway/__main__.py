from rollout_gateway.cli import main

raise SystemExit(main())
