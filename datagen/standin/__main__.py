"""`python -m datagen.standin`: the SGLang stand-in server."""

from datagen.standin.cli import main

raise SystemExit(main())
