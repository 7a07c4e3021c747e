"""``python -m gatekeeper.cli``: the same command line as ``gatekeeper``."""

from . import app

app()
