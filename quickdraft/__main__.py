"""`python -m quickdraft` == the `quickdraft` console script."""

from quickdraft.cli import main

raise SystemExit(main())
