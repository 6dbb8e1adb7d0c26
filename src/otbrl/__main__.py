from otbrl.cli import main

raise SystemExit(main())
