"""`python -m rbcompile.frontend.cli`."""
from rbcompile.frontend.cli import entry

entry()
