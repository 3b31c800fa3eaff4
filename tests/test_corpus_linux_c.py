"""benchmarks/corpus_linux_c.sh, the second corpus of issue 54, on a local package: a .deb built here in
Debian's layout stands in for linux-source-6.1, and a stand-in apt-get on PATH hands it over (or fails, as
offline). What the script must do: keep the C sources of kernel/, mm/, fs/ and net/ only, one document per file,
name the package it was built from, pin a version when asked, and refuse in one line when it cannot download."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "corpus_linux_c.sh"
pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian)")

KEPT = {"kernel/fork.c": "int fork(void) { return 0; }\n", "mm/slab.h": "#define SLAB 1\n",
        "net/ipv4/tcp.c": "/* tcp */\nint tcp;\n"}
DROPPED = {"drivers/gpu/x.c": "int x;\n", "kernel/Makefile": "obj-y += fork.o\n", "fs/empty.c": "  \n\n"}


def _package(tmp: Path) -> Path:
    src = tmp / "src" / "linux-source-6.1"
    for rel, text in {**KEPT, **DROPPED}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    pkg = tmp / "pkg"
    (pkg / "usr" / "src").mkdir(parents=True)
    with tarfile.open(pkg / "usr" / "src" / "linux-source-6.1.tar.xz", "w:xz") as tar:
        tar.add(src, arcname="linux-source-6.1")
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN" / "control").write_text("Package: linux-source-6.1\nVersion: 9.9-1\nArchitecture: all\n"
                                            "Maintainer: test <t@example.org>\nDescription: test\n")
    deb = tmp / "linux-source-6.1_9.9-1_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(deb)], check=True,
                   capture_output=True)
    return deb


def _run(tmp: Path, out: Path, *, deb: Path | None, version: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "apt-get"
    body = f'cp "{deb}" .' if deb else "exit 100"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{tmp}/apt-get.args"\n{body}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("LINUX_C_VERSION", None)
    if version:
        env["LINUX_C_VERSION"] = version
    return subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)


def test_the_corpus_keeps_the_c_sources_of_four_trees_one_document_per_file(tmp_path):
    deb = _package(tmp_path)
    out = tmp_path / "linux-c"
    r = _run(tmp_path, out, deb=deb, version="9.9-1")
    assert r.returncode == 0, r.stderr
    docs = [json.loads(line)["text"] for line in (out / "linux-c.jsonl").read_text().splitlines()]
    assert sorted(docs) == sorted(KEPT.values())
    assert (out / "SOURCE").read_text().startswith("linux-source-6.1_9.9-1_all.deb")
    assert "download linux-source-6.1=9.9-1" in (tmp_path / "apt-get.args").read_text()
    # a second call finds the corpus and downloads nothing
    again = _run(tmp_path, out, deb=None)
    assert again.returncode == 0 and "exists (linux-source-6.1_9.9-1_all.deb" in again.stdout
    assert (tmp_path / "apt-get.args").read_text().count("download") == 1


def test_offline_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "linux-c"
    r = _run(tmp_path, out, deb=None)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "corpus_linux_c.sh: cannot download linux-source-6.1 (offline, or apt-get update first?)"]
    assert not out.exists()
    # without a version asked for, the index's candidate: the package name alone
    assert (tmp_path / "apt-get.args").read_text().split()[-1] == "linux-source-6.1"
