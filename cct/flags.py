"""Command-line flags parsed as Caffe's gflags parses them, on top of :mod:`argparse`.

gflags (the library behind ``caffe`` and its tools) accepts ``-flag value``, ``--flag value``,
``-flag=value`` and ``--flag=value`` alike. A *boolean* flag never takes the next word as its value:
``--shuffle``, ``--shuffle=true|false|1|0`` and ``--noshuffle`` are its spellings, so
``convert_imageset --shuffle ROOT/ LIST DB`` keeps ``ROOT/`` a positional argument.

:class:`FlagParser` is an :class:`argparse.ArgumentParser` with a pre-pass that rewrites a gflags-style
command line into the GNU form argparse reads (``-solver S`` -> ``--solver S``, ``--noshuffle`` ->
``--shuffle=false``). Boolean flags are stored as actions that require an attached value; the pre-pass
supplies it, so argparse never consumes a positional after them. Flags added with the usual
``action="store_true"`` become such booleans too, so every command takes the same spellings.

Why not ``absl-py`` (which parses gflags syntax natively)? Its flags live in one process-wide
``FlagValues`` registry: defining the same flag in two commands, or parsing two command lines in one
process (the tests, ``cct`` called from Python), mutates global state, which this project rules out.
argparse parsers are plain objects, one per command, and give ``--help`` and error messages for free.

Help lists every flag with its default; a parser built by :func:`command_parser` names itself
``cct <command>`` in usage lines and errors. Errors raise :class:`FlagError` (a :class:`CctError`).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from .errors import CctError

__all__ = ["FlagError", "FlagParser", "add_progress_flag", "command_parser", "parse_bool", "to_gnu"]

_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")
_LONG = re.compile(r"^--?([A-Za-z_][A-Za-z0-9_-]*)(=.*)?$", re.S)


class FlagError(CctError):
    """A command line that does not parse: unknown flag, missing argument, bad value."""


def parse_bool(text: str | bool) -> bool:
    """A gflags boolean value: true/false, t/f, 1/0, yes/no (any case)."""
    if isinstance(text, bool):
        return text
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: '{text}' (use true or false)")


class _BoolAction(argparse.Action):
    """A boolean flag; the value is always attached (``--flag=true``) by :func:`to_gnu`."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None, **_: Any):
        super().__init__(option_strings, dest, nargs=None, default=default, type=parse_bool, required=required,
                         help=help, metavar="BOOL")

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _StoreFalse(_BoolAction):
    """``action="store_false"``: the flag given alone stores False; ``--flag=false`` stores True."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not values)


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(action, _BoolAction)


def _long_name(action: argparse.Action) -> str | None:
    for s in action.option_strings:
        if s.startswith("--"):
            return s[2:]
    return None


def to_gnu(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Rewrite a gflags-style command line for ``parser`` into GNU form (see the module docstring).

    Words after a bare ``--`` are positionals and are left alone; unknown flags are left for argparse
    to report. The value word after a non-boolean flag is never rewritten.
    """
    options = parser._option_string_actions
    out: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--":
            out.extend(argv[i - 1:])
            break
        m = _LONG.match(word)
        if not m:
            out.append(word)
            continue
        name, value = m.group(1), m.group(2)
        spelled = word.split("=", 1)[0]
        action = options.get(spelled) if spelled in options and len(spelled) == 2 else options.get("--" + name)
        negated = False
        if action is None and name.startswith("no") and options.get("--" + name[2:]) is not None:
            cand = options["--" + name[2:]]
            if _is_bool(cand) and value is None:
                action, negated = cand, True
        if action is None:
            out.append(word)
            continue
        long = _long_name(action) or spelled.lstrip("-")
        if _is_bool(action):
            text = "false" if negated else ("true" if value is None else value[1:])
            out.append(f"--{long}={text}")
        elif value is not None:
            out.append(f"--{long}{value}")
        else:
            if action.nargs in (None, 1) and i < len(argv):
                out.append(f"--{long}={argv[i]}")  # the next word is the value, even if it starts with '-'
                i += 1
            else:
                out.append(f"--{long}")
    return out


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` on every flag with a default, and booleans as ``--flag, --noflag``."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.default is None or action.default == "" or action.default == []:
            return text
        default = str(action.default).lower() if isinstance(action.default, bool) else "%(default)s"
        return f"{text} (default: {default})" if text else f"(default: {default})"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if _is_bool(action):
            long = _long_name(action)
            names = list(action.option_strings)
            if long:
                names.append(f"--no{long}")
            return ", ".join(names)
        return super()._format_action_invocation(action)

    def _format_usage(self, usage, actions, groups, prefix) -> str:
        return super()._format_usage(usage, actions, groups, prefix).replace(" BOOL]", "]")


class FlagParser(argparse.ArgumentParser):
    """An argparse parser reading gflags syntax; errors raise :class:`FlagError` instead of exiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's; ``store_true``/``store_false`` flags become gflags booleans."""
        action = kwargs.get("action")
        if action == "store_true":
            kwargs["action"] = _BoolAction
            kwargs.setdefault("default", False)
        elif action == "store_false":
            kwargs["action"] = _StoreFalse
            kwargs.setdefault("default", True)
        return super().add_argument(*args, **kwargs)

    def add_bool(self, name: str, help: str, default: bool = False) -> argparse.Action:
        """A boolean flag ``--name`` (``--name=true|false``, ``--noname``)."""
        return self.add_argument(f"--{name}", dest=name, action=_BoolAction, default=default, help=help)

    def add_flag(self, name: str, **kwargs: Any) -> argparse.Action:
        """A valued flag ``--name V`` (also ``-name V``, ``--name=V``, ``-name=V``)."""
        kwargs.setdefault("dest", name)
        return self.add_argument(f"--{name}", **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse hook
        return super().parse_known_args(to_gnu(self, sys.argv[1:] if args is None else args), namespace)

    def error(self, message: str):  # noqa: D102 - argparse hook
        raise FlagError(f"{message} (see '{self.prog} --help')")


def command_parser(command: str, description: str, epilog: str | None = None) -> FlagParser:
    """The parser of ``cct <command>`` (its usage line and errors say ``cct <command>``)."""
    return FlagParser(prog=f"cct {command}", description=description, epilog=epilog)


def add_progress_flag(parser: FlagParser) -> None:
    """``--progress`` / ``--noprogress``: the progress bar of a long command (see :mod:`cct.progress`)."""
    parser.add_bool("progress", "show a progress bar (count, rate, ETA) when stderr is a terminal; "
                    "CCT_PROGRESS=0 also turns it off", default=True)
