from omni_client.cli import main

raise SystemExit(main())
