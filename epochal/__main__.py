"""``python -m epochal``: the same command line as the ``epochal`` script."""

from epochal.cli.parser import main

raise SystemExit(main())
