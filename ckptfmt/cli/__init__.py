"""The ``ckptfmt`` command: ls, show, verify, diff, the analytics and lifecycle commands (rm, gc, sync,
advise), and the commands other packages register.

``export``/``import`` (ckptfmt.converters) and ``tui`` (ckptfmt.tui) come in
through the ``ckptfmt.commands`` entry point group: each entry point names a
``register(subparsers)`` function. The core never imports those packages.

Errors print one line and exit non-zero (2; verify finding damage exits 1);
``--debug`` shows the traceback. ckptfmt's warnings (``CheckpointWarning``)
print as ``ckptfmt: warning: ...`` lines once the command has succeeded; other
libraries' warnings show only with ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from rich.console import Console

import ckptfmt
from ckptfmt.cli import advise, analysis, checking, health, lifecycle, listing, showing, signing, sync
from ckptfmt.errors import CheckpointError, CheckpointWarning
from ckptfmt.format.features import version_text
from ckptfmt.format.version import FORMAT_VERSION, OLDEST_READ
from ckptfmt.tools.output import Output

#: The entry point group of commands that live outside the core.
COMMANDS_GROUP = "ckptfmt.commands"
#: The core commands' modules, in the order ``ckptfmt --help`` lists their commands. Each adds its commands
#: with ``register(subparsers)``, as the entry points of ``COMMANDS_GROUP`` do, and imports the work of a
#: command only when it runs: building the parser loads none of what the commands need (torch, pyarrow, fsspec).
COMMAND_MODULES = (listing, showing, checking, analysis, health, lifecycle, sync, signing, advise)


def build_parser(*, plugins: bool = True) -> argparse.ArgumentParser:
    """The ``ckptfmt`` command's parser; ``plugins``: with the commands other packages register (finding
    them scans every installed package's metadata: left out where the command is a core one)."""
    parser = _Parser(prog="ckptfmt", description="Inspect, verify and convert ckptfmt checkpoints.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show the package version and the format version it writes, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    if plugins:
        from importlib.metadata import entry_points  # a scan of every installed package's metadata

        for plugin in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
            _register(plugin, sub)
    _debug_anywhere(parser)
    return parser


def _debug_anywhere(parser: argparse.ArgumentParser) -> None:
    """Accept --debug after the command too (``ckptfmt ls X --debug``), on every command and subcommand;
    SUPPRESS keeps a subcommand from resetting what the top level parsed."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if "--debug" not in command._option_string_actions:
                    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                         help="show tracebacks on errors")
                _debug_anywhere(command)


class _Version(argparse.Action):
    """``--version``: the package's version (read from its metadata only when asked for) and the format
    versions it reads and writes: the two halves of what a release promises (CHANGELOG.md); then which
    kernels run (C, or numpy where the extension was not built)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ckptfmt import kernels

        writes = version_text(FORMAT_VERSION)
        print(f"ckptfmt {ckptfmt.__version__}, reads format {version_text(OLDEST_READ)}-{writes}, writes {writes}")  # noqa: T201
        print(f"kernels: {kernels.describe()}")  # noqa: T201
        parser.exit()


def _needs_plugins(argv: list[str]) -> bool:
    """Whether the command line may name a command that another package registers (or asks for the list):
    anything but a core command's name as its first word, and not ``--version``."""
    if "--version" in argv:
        return False
    first = next((word for word in argv if not word.startswith("-")), None)
    return first not in _core_commands()


def _core_commands() -> set[str]:
    action = next(a for a in build_parser(plugins=False)._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


class _Parser(argparse.ArgumentParser):
    """argparse, with its error line printed as the CLI's are (wrapped between values in a terminal);
    its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        Output(Console(stderr=True)).line(f"{self.prog}: error: {message}")
        sys.exit(2)


def _register(plugin, sub: argparse._SubParsersAction) -> None:
    """Let an installed package add its commands; one that cannot load is left out, with a warning."""
    try:
        register = plugin.load()
        register(sub)
    except Exception as exc:  # a broken or partial install must not take ls/show/verify down with it
        # The parser is built before the command's Output exists: a plain line on stderr.
        print(f"ckptfmt: warning: commands from {plugin.value} are unavailable: {exc}", file=sys.stderr)  # noqa: T201


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(plugins=_needs_plugins(argv)).parse_args(argv)
    console = _Stdout()
    errors = Console(stderr=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _run(args, console, errors)
    _print_warnings(caught, errors, debug=args.debug, failed=code == 2)
    return code


def _run(args, console: Console, errors: Console) -> int:
    """The command's exit code; an exception becomes one line on stderr (and code 2, or 130)."""
    try:
        return args.run(args, console) or 0
    except BrokenPipeError:  # the reader went away (`ckptfmt show X | head`): what it took was all it wanted
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        errors.print("ckptfmt: interrupted")
        return 130
    except CheckpointError as exc:
        if args.debug:
            errors.print_exception()
        _error_line(errors, str(exc))
        return 2
    except Exception as exc:  # a bug, or an environment problem we did not foresee
        if args.debug:
            errors.print_exception()
        _error_line(errors, f"unexpected failure ({exc or 'no message'}); rerun with --debug for details")
        return 2


class _Stdout(Console):
    """stdout, where a closed pipe ends the command (``_run``): rich's own reaction is to exit with 1,
    which fails a ``set -o pipefail`` script piping ``ckptfmt show`` into ``head``."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _error_line(errors: Console, message: str) -> None:
    """The error as one line (wrapped between values in a terminal)."""
    Output(errors).line(f"ckptfmt: error: {message}")


def _print_warnings(caught: list[warnings.WarningMessage], errors: Console, *, debug: bool, failed: bool) -> None:
    """ckptfmt's warnings as one line each (each message once), unless the command failed: then the
    error line is all the user sees. Other libraries' warnings only with --debug."""
    seen = set()
    for warning in caught:
        if issubclass(warning.category, CheckpointWarning):
            message = str(warning.message)
            if not failed and message not in seen:
                seen.add(message)
                Output(errors).line(f"ckptfmt: warning: {message}")
        elif debug:
            errors.print(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                                warning.lineno), markup=False, highlight=False, end="")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
