"""Error types. A `UserError` is bad input: the CLI prints its message on one line and exits 2."""


class UserError(ValueError):
    """Bad input from the user (missing files, unknown architecture, bad options...)."""


class CompileError(UserError):
    """The model's graph does not have a structure rbcompile can compile."""
