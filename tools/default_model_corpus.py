"""The default model's corpus: the standard library with its fixed held-out modules, and as
extra training text the Python sources of installed packages whose licence is permissive, each
listed with its licence (``training_metadata.json``).

A package counts when its metadata names a permissive licence (MIT, BSD, Apache, PSF, ISC,
Unlicense, zlib, HPND; anything mentioning GPL is left out). Files are skipped when they sit in
test or vendored directories, are larger than ``MAX_FILE_BYTES`` (generated tables), or have
the same text as a held-out standard-library module (a copy would leak the held-out set); at
most ``MAX_PACKAGE_BYTES`` of text per package, so a few large packages do not dominate.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import sysconfig
from pathlib import Path

# Held-out modules, relative to the stdlib root; never trained on and never seen by the tokenizer trainer.
HELDOUT_MODULES = (
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "shlex.py",
    "fractions.py",
    "queue.py",
    "graphlib.py",
    "json/encoder.py",
    "json/decoder.py",
    "email/quoprimime.py",
)
# Directories skipped entirely: tests, third-party packages, and generated tables (codec maps,
# pydoc topic dumps) whose text is not representative Python.
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__", "__phello__"}
SKIP_PREFIXES = ("_sysconfigdata", "config-")

PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC", "Unlicense",
              "zlib", "HPND")
SKIP_PARTS = {"test", "tests", "testing", "_vendor", "vendored", "__pycache__", "examples"}
MAX_FILE_BYTES = 400_000
MAX_PACKAGE_BYTES = 2_000_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Return (train, heldout) relative paths, sorted; heldout is HELDOUT_MODULES in listed order."""
    train = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith(SKIP_PREFIXES):
            continue
        if rel.name.startswith(SKIP_PREFIXES) or rel.as_posix() in HELDOUT_MODULES:
            continue
        train.append(rel.as_posix())
    missing = [m for m in HELDOUT_MODULES if not (root / m).is_file()]
    if missing:
        raise FileNotFoundError(f"held-out modules {missing} not found under stdlib root {root}")
    return sorted(train), list(HELDOUT_MODULES)


def read_texts(root: Path, rels: list[str]) -> list[str]:
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in rels]


def build_corpus(corpus: str, max_files: int | None) -> dict:
    """Training and held-out texts, the training file list and the packages used."""
    root = stdlib_root()
    train_rels, held_rels = split_corpus(root)
    train_rels = train_rels[:max_files] if max_files else train_rels
    train_texts, held_texts = read_texts(root, train_rels), read_texts(root, held_rels)
    packages: list[dict] = []
    if corpus == "stdlib+packages":
        extra, packages = package_sources(held_texts, exclude={"vllm-moe-cache"})
        train_texts += extra
    return {"root": root, "train_rels": train_rels, "held_rels": held_rels, "train": train_texts,
            "held": held_texts, "packages": packages}


def licence_of(dist: md.Distribution) -> str | None:
    """The permissive licence a distribution declares (metadata License-Expression, License or
    classifiers), or None."""
    meta = dist.metadata
    fields = [meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
    fields += [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    for text in fields:
        if any(p.lower() in text.lower() for p in PERMISSIVE) and "GPL" not in text:
            return text.strip().splitlines()[0][:120]
    return None


def package_sources(heldout_texts: list[str], exclude: set[str] = frozenset()
                    ) -> tuple[list[str], list[dict]]:
    """(texts, packages): every kept .py file's text, sorted by (package, path), and one entry
    per package used: name, version, licence, files, bytes."""
    held = {hashlib.sha256(t.encode()).hexdigest() for t in heldout_texts}
    texts: list[str] = []
    packages: list[dict] = []
    seen: set[str] = set()
    for dist in sorted(md.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or ""
        licence = licence_of(dist)
        if not licence or name.lower() in seen or name.lower() in exclude:
            continue
        seen.add(name.lower())
        kept = _package_files(dist, held)
        if kept:
            texts.extend(kept)
            packages.append({"name": name, "version": dist.version, "licence": licence,
                             "files": len(kept), "bytes": sum(len(t) for t in kept)})
    return texts, packages


def _package_files(dist: md.Distribution, held: set[str]) -> list[str]:
    out, total = [], 0
    for f in sorted(dist.files or [], key=str):
        if total >= MAX_PACKAGE_BYTES:
            break
        if f.suffix != ".py" or any(p in SKIP_PARTS for p in f.parts[:-1]):
            continue
        path = Path(dist.locate_file(f))
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and hashlib.sha256(text.encode()).hexdigest() not in held:
            out.append(text)
            total += len(text)
    return out
