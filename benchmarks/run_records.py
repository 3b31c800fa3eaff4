"""The finished runs of a study, kept in the repository, so that a study that spans sessions outlives the
machine it runs on (on 2026-12-04 a fresh machine lost every run of the CPU budget study; only the figures
written into its report were left).

    python benchmarks/run_records.py save OUT RECORDS   # every finished run of OUT into RECORDS
    python benchmarks/run_records.py load RECORDS OUT   # each record into OUT, where OUT lacks that finished run

RECORDS mirrors OUT without its ``runs`` folders (``STAGE/tokens.../seedN/RUN`` for ``STAGE/runs/tokens.../
seedN/RUN``), which the repository's .gitignore leaves out wherever they are.

A record is what the report and ``--resume`` read of a run: its configuration, summary, environment (the
commits it ran from) and ``metrics.jsonl`` (gzipped, byte-stable, so that saving again changes nothing);
no checkpoints and no weights. A loaded run counts as finished only where its ``config.json`` is the run a
study asks for (``Runner.finished``); any other is run again.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import run_folders  # noqa: E402  (the study's folder layout, in one place)

FILES = ("config.json", "requested_config.json", "environment.json")
SUMMARY, METRICS = "summary.json", "metrics.jsonl"


def _read(path: Path) -> bytes:
    """A regular file's bytes; a symlink is refused (a record loads only what it checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _write(path: Path, data: bytes) -> bool:
    """Atomically, and only if the bytes differ; whether it wrote."""
    if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def _gzip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as f:  # no time or name: byte-stable
        f.write(data)
    return buf.getvalue()


def save(out: Path, records: Path) -> list[Path]:
    """Every finished run (with a summary.json) of ``out`` into ``records``; the records written or changed."""
    changed = []
    for _, run, _ in run_folders(out):
        if not (run / SUMMARY).is_file():
            continue
        stage, _, *rest = run.relative_to(out).parts  # _: "runs"
        dest = records.joinpath(stage, *rest)
        dest.mkdir(parents=True, exist_ok=True)
        wrote = [_write(dest / name, _read(run / name)) for name in (*FILES, SUMMARY) if (run / name).exists()]
        if (run / METRICS).exists():
            wrote.append(_write(dest / f"{METRICS}.gz", _gzip(_read(run / METRICS))))
        if any(wrote):
            changed.append(dest)
    return changed


def load(records: Path, out: Path) -> list[Path]:
    """Each record into ``out`` where ``out`` has no finished run in its folder; the runs loaded."""
    loaded = []
    for summary in sorted(records.glob(f"*/*/seed*/*/{SUMMARY}")):
        rec = summary.parent
        stage, *rest = rec.relative_to(records).parts
        run = out.joinpath(stage, "runs", *rest)
        if (run / SUMMARY).is_file():
            continue  # finished here: this machine's run wins
        run.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (rec / name).exists():
                _write(run / name, _read(rec / name))
        if (rec / f"{METRICS}.gz").exists():
            _write(run / METRICS, gzip.decompress(_read(rec / f"{METRICS}.gz")))
        # the summary last: until it is there, a cut-short load is a run that has not finished
        _write(run / SUMMARY, _read(summary))
        loaded.append(run)
    return loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("save", "load"))
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    if not a.src.is_dir():
        print(f"run_records.py: {a.src} is not a folder", file=sys.stderr)
        return 2
    a.dest.mkdir(parents=True, exist_ok=True)
    done = (save if a.action == "save" else load)(a.src.resolve(), a.dest.resolve())
    print(f"run_records.py: {a.action} {a.src} -> {a.dest}: {len(done)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
