"""A mistyped command or flag, or a path that starts with ``-``, told in one line with the closest spelling.

argparse alone answers ``blockfs mount ds mnt --cache-sise 8GiB`` with the top-level usage and
"unrecognized arguments"; here the answer is the command's own usage line and
``blockfs mount: error: unrecognized argument --cache-sise (did you mean --cache-size?)``, the guesses
coming from :mod:`difflib` over the command's flags and the command names.
"""

from __future__ import annotations

import argparse
import difflib

# Options of the top-level parser that take a value (skipped when looking for the command).
_TOP_VALUED = ("--log-level",)


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's commands by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def usage_line(sub: argparse.ArgumentParser) -> str:
    """``usage: blockfs mount [OPTIONS] dest mountpoint``: one line, where argparse's usage of a command
    with many flags runs to a screenful."""
    positionals = []
    for action in sub._actions:
        if action.option_strings or action.help == argparse.SUPPRESS:
            continue
        name = action.metavar or action.dest
        positionals.append(
            f"[{name}]" if action.nargs == "?" else f"{name} [{name} ...]" if action.nargs == "+" else str(name)
        )
    return f"usage: {sub.prog} [OPTIONS] {' '.join(positionals)}  ('{sub.prog} --help' lists the options)"


def unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error line for a command that is not one (``blockfs mout``), or None."""
    names = commands(parser)
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in _TOP_VALUED else 1
    if i >= len(argv) or argv[i] in names or argv[i] == "--":
        return None
    word = argv[i]
    guess = difflib.get_close_matches(word, names, n=1)
    hint = f"did you mean {guess[0]}?" if guess else f"the commands: {', '.join(names)}"
    return f"{parser.prog}: error: unknown command {word!r} ({hint})"


def unrecognized(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> str:
    """The error line for arguments ``command``'s parser did not take: the first flag-like one (a typo is
    usually that), its closest spellings, and how to give a path that starts with ``-``."""
    sub = commands(parser)[command]
    word = next((x for x in extras if x.startswith("-")), extras[0])
    flag = word.partition("=")[0]
    flags = [s for a in sub._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
    guess = difflib.get_close_matches(flag, flags, n=1) or difflib.get_close_matches(flag, commands(parser), n=1)
    line = f"{sub.prog}: error: unrecognized argument {word}" + (f" (did you mean {guess[0]}?)" if guess else "")
    if word.startswith("-") and not word.startswith("--"):
        line += f"; a path that begins with '-' goes after '--': {sub.prog} ... -- {word}, or write it as ./{word}"
    return line
