# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step 1: the text corpus, from this interpreter's standard library and site-packages.

Every ``.py``, ``.rst``, ``.md`` and ``.txt`` file under the roots is a document,
named by its root tag and relative path (``stdlib/json/decoder.py``,
``site0/torch/nn/functional.py``). Documents are taken in the order of the SHA-256 of
their name until the byte caps are reached, so the corpus is a spread-out sample that
only depends on which files the machine has; a second hash of the name puts about
``heldout_per_mille`` of them in the held-out part.
"""

import hashlib
import json
import os
import platform
import site
import sysconfig
import time
from pathlib import Path

from .config import CorpusScale, Paths
from .runlog import log, update_summary, write_json

SUFFIXES = (".py", ".rst", ".md", ".txt")
SKIPPED_DIRS = ("__pycache__",)
SKIPPED_DIR_SUFFIXES = (".dist-info", ".egg-info")


def source_roots() -> list[tuple[str, Path]]:
    """``(tag, directory)``: the standard library, then each site-packages."""
    paths = sysconfig.get_paths()
    sites = sorted({paths["purelib"], paths["platlib"], *site.getsitepackages()})
    found, seen = [], set()
    for candidate in [paths["stdlib"], *sites]:
        real = Path(os.path.realpath(candidate))
        if real.is_dir() and real not in seen:
            seen.add(real)
            found.append(real)
    return [("stdlib" if i == 0 else f"site{i - 1}", r) for i, r in enumerate(found)]


def list_documents(max_file_bytes: int) -> list[tuple[str, Path]]:
    """``(name, path)`` of every candidate file, in hash order."""
    roots = source_roots()
    other_roots = {r for _, r in roots}
    docs = []
    for tag, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if here / d not in other_roots
                and d not in SKIPPED_DIRS
                and not d.startswith(".")
                and not d.endswith(SKIPPED_DIR_SUFFIXES)
            )
            for name in sorted(filenames):
                path = here / name
                if name.endswith(SUFFIXES) and 0 < _size(path) <= max_file_bytes:
                    docs.append((f"{tag}/{path.relative_to(root).as_posix()}", path))
    docs.sort(key=lambda doc: _hash("order", doc[0]))
    return docs


def is_heldout(name: str, per_mille: int) -> bool:
    return int(_hash("split", name)[:8], 16) % 1000 < per_mille


def read_text(path: Path) -> str | None:
    """The file's text, or None for unreadable, non-UTF-8 or binary files."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\x00" in text or not text.strip() else text


def run(paths: Paths, scale: CorpusScale) -> dict:
    t0 = time.perf_counter()
    candidates = list_documents(scale.max_file_bytes)
    log.info("corpus: %d candidate files", len(candidates))
    parts = {"train": _Part(scale.train_bytes), "heldout": _Part(scale.heldout_bytes)}
    for name, path in candidates:
        part = parts[
            "heldout" if is_heldout(name, scale.heldout_per_mille) else "train"
        ]
        if part.full():
            if all(p.full() for p in parts.values()):
                break
            continue
        text = read_text(path)
        if text is not None:
            part.add(name, text)
    paths.corpus.mkdir(parents=True, exist_ok=True)
    parts["train"].write(paths.train_docs)
    parts["heldout"].write(paths.heldout_docs)
    result = {
        "python": platform.python_version(),
        "roots": {tag: str(root) for tag, root in source_roots()},
        "candidate_files": len(candidates),
        **{f"{k}_{stat}": v for k, p in parts.items() for stat, v in p.stats().items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(
        paths.manifest, {**result, **{f"{k}_names": p.names for k, p in parts.items()}}
    )
    update_summary(paths, "corpus", result)
    log.info("corpus: %s", json.dumps(result))
    return result


class _Part:
    def __init__(self, cap: int):
        self.cap, self.bytes = cap, 0
        self.names: list[str] = []
        self.texts: list[str] = []
        self.digest = hashlib.sha256()

    def full(self) -> bool:
        return self.bytes >= self.cap

    def add(self, name: str, text: str) -> None:
        self.names.append(name)
        self.texts.append(text)
        self.bytes += len(text.encode("utf-8"))
        self.digest.update(f"{name}\0{text}\0".encode())

    def write(self, path: Path) -> None:
        with path.open("w") as f:
            for name, text in zip(self.names, self.texts, strict=True):
                f.write(json.dumps({"name": name, "text": text}) + "\n")

    def stats(self) -> dict:
        return {
            "files": len(self.names),
            "bytes": self.bytes,
            "sha256": self.digest.hexdigest(),
        }


def read_documents(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def _hash(salt: str, name: str) -> str:
    return hashlib.sha256(f"{salt}:{name}".encode()).hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0
