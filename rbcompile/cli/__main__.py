"""`python -m rbcompile.cli`."""
from . import entry

entry()
