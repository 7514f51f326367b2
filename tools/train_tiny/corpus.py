"""Build the training corpus: the Python standard library's own source files.

Rule (documented in README.md): every `*.py` file under `sysconfig.get_paths()["stdlib"]`, walked
recursively, relative POSIX paths sorted, skipping any path with a folder named `site-packages`,
`test`, `tests`, `idle_test`, `__pycache__`, `encodings` (generated codec tables) or `pydoc_data`
(generated doc strings), any folder starting with `config-` (build files) and files starting with
`_sysconfigdata` (this machine's build settings). The split reads the first 8 hex digits of
sha256(relative path) as an integer h: h mod 100 < 5 is `heldout` (about 5 %, never trained on nor
used to pick a checkpoint), < 8 is `valid` (about 3 %, picks the checkpoint), the rest is `train`;
so a file's split never depends on the file list.

    python tools/train_tiny/corpus.py --out out/tiny

writes `manifest.json`: the Python version, the stdlib folder, and every kept file with its split,
size and sha256; `documents()` reads a split back (checking every hash), one string per file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"})
SPLITS = ("train", "valid", "heldout")
HELDOUT_PERCENT, VALID_PERCENT = 5, 3


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_corpus_file(rel: Path) -> bool:
    """True for a stdlib-relative path the corpus keeps."""
    if rel.suffix != ".py" or rel.name.startswith("_sysconfigdata"):
        return False
    folders = rel.parts[:-1]
    return not any(part in SKIP_DIRS or part.startswith("config-") for part in folders)


def split_of(rel: Path) -> str:
    """Stable split from sha256 of the relative POSIX path (see the module docstring)."""
    bucket = int(hashlib.sha256(rel.as_posix().encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    return "valid" if bucket < HELDOUT_PERCENT + VALID_PERCENT else "train"


def list_files(root: Path) -> list[Path]:
    """Corpus files as stdlib-relative paths, sorted by their POSIX form."""
    found = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted((rel for rel in found if is_corpus_file(rel)), key=lambda rel: rel.as_posix())


def build(root: Path, out: Path) -> dict:
    """Hash every corpus file (UTF-8, strict) and write `out/manifest.json`; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for rel in list_files(root):
        raw = (root / rel).read_bytes()
        raw.decode("utf-8")                 # a non-UTF-8 stdlib file would be a surprise: fail loudly
        entries.append({"path": rel.as_posix(), "split": split_of(rel),
                        "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
    summary = {}
    for split in SPLITS:
        chosen = [e for e in entries if e["split"] == split]
        fingerprint = hashlib.sha256("".join(e["sha256"] for e in chosen).encode("ascii")).hexdigest()
        summary[split] = {"files": len(chosen), "bytes": sum(e["bytes"] for e in chosen), "sha256": fingerprint}
    manifest = {"python": platform.python_version(), "stdlib": str(root), "rule": __doc__.split("\n\n")[1],
                "summary": summary, "files": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return summary


def documents(manifest_path: Path, split: str) -> list[str]:
    """The texts of one split ("train", "valid" or "heldout"), in manifest order.

    Raises:
        ValueError: unknown split, or a file whose bytes no longer match the manifest's sha256
            (another Python build: rebuild the manifest, see README.md).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    root = Path(manifest["stdlib"])
    texts = []
    for entry in manifest["files"]:
        if entry["split"] != split:
            continue
        raw = (root / entry["path"]).read_bytes()
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise ValueError(f"{entry['path']}: sha256 differs from {manifest_path} (Python {manifest['python']})")
        texts.append(raw.decode("utf-8"))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/tiny"))
    parser.add_argument("--stdlib", type=Path, default=None, help="default: this interpreter's stdlib")
    args = parser.parse_args()
    summary = build(args.stdlib or stdlib_root(), args.out)
    print(json.dumps({"python": platform.python_version(), **summary}, indent=1))


if __name__ == "__main__":
    main()
