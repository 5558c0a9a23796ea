"""Error types. A `UserError` is bad input: the CLI prints its message on one line and exits 2."""


class UserError(ValueError):
    """Bad input from the user (missing files, unknown architecture, bad options...)."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CompileError(UserError):
    """The model's graph does not have a structure rbcompile can compile."""


def check_unicode(text: str, what: str) -> str:
    """`text` unchanged, or a UserError naming the first character that is not valid Unicode
    (a lone surrogate: invalid UTF-8 from the command line, or `\\ud800` in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{what} is not valid Unicode: character {exc.start} "
                        f"({text[exc.start]!a}) cannot be encoded as UTF-8") from None
    return text
