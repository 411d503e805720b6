"""The ``verispec`` command: generate, bench, tune, serve, distill, ngrams.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them. User errors (:class:`~verispec.config.ConfigError`) print one line and
exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from verispec.config import ConfigError

SUBCOMMANDS = {
    "generate": ("verispec.commands.generate", "generate text with speculative decoding"),
    "bench": ("verispec.bench.cli", "benchmark methods and peers on Spec-Bench prompts"),
    "tune": ("verispec.bench.tune", "measure draft cost and acceptance, and pick k"),
    "serve": ("verispec.entrypoints.openai.api_server", "OpenAI-compatible server"),
    "distill": ("verispec.distill.cli", "train a small draft for a target"),
    "ngrams": ("verispec.commands.ngrams", "build an n-gram table of a target's own answers"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with each available subcommand's arguments."""
    parser = _Parser(prog="verispec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("verispec"):
                continue  # a subcommand not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from verispec import __version__

    return f"verispec {__version__}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``verispec`` script."""
    logging.basicConfig(level=logging.WARNING, format="verispec: %(message)s")
    args = build_parser().parse_args(argv)
    return call(args.command, args._run, args)


def call(command: str, run, args: argparse.Namespace) -> int:
    """Run a subcommand: user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        return int(run(args) or 0)
    except ConfigError as exc:
        print(f"verispec {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
