"""`python -m folio` runs the `folio` command."""

from folio.cli import main

raise SystemExit(main())
