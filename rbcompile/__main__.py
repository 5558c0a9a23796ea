from rbcompile.frontend.cli import entry

entry()
