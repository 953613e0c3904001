from omni_server.cli import main

raise SystemExit(main())
