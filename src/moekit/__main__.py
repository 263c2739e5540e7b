from moekit.cli import main

raise SystemExit(main())
