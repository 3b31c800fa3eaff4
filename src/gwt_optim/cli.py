"""The ``gwt-optim`` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds an ``argparse`` sub-parser and sets ``func`` on it. Command modules
must import their heavy optional dependencies (transformers, datasets, ...)
inside the function that runs the command, so that ``gwt-optim --help`` and
the torch-only ``memory`` command work with nothing but torch installed.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# Order is the order shown by --help.
COMMAND_MODULES: tuple[str, ...] = (
    "gwt_optim.toolkit.pretrain",  # pretrain
    "gwt_optim.toolkit.compare",  # compare (the main job)
    "gwt_optim.toolkit.report",  # report
    "gwt_optim.toolkit.finetune",  # finetune glue | lm
    "gwt_optim.memory",  # memory
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gwt-optim",
        description=(
            "Gradient Wavelet Transform optimizers: train, compare and measure "
            "GWT against AdamW, 8-bit Adam, GaLore, APOLLO, Adam-mini and Muon."
        ),
    )
    from gwt_optim import __version__

    parser.add_argument("--version", action="version", version=f"gwt-optim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command still being written
            if exc.name and exc.name.startswith("gwt_optim"):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from gwt_optim.toolkit.errors import run_command

    try:
        return run_command(args.command, args.func, args)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)  # training's Stopped says which signal
        print("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
              file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
