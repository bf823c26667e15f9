"""The import root: `src/`, a folder in which `canvasroute` is this checkout, as the wheel lays it out.

The layer folders sit at the top of the repository (engine/ router/ harness/ apps/); canvasroute/
holds a symlink to each (`canvasroute/engine -> ../engine`), and src/ holds one symlink,
`src/canvasroute -> ../canvasroute`. pyproject.toml's `package-dir` is `{"" = "src"}`, so an
editable install is that folder on `sys.path` (a static .pth line mypy and pyright follow), and
tests/conftest.py puts it first on `sys.path` (and on every child process's PYTHONPATH) so
`canvasroute` imports from a checkout without installing it; scripts/check.sh runs mypy in it.

The links are committed; `build` repairs them where a checkout lost them (an archive without
symlinks). Usage: `python scripts/import_root.py` checks (or repairs) them and prints the import
root. Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "router", "harness", "apps")
"""`canvasroute.<name>` -> the folder `<name>` at the top of the repository."""


def layers(root: Path = ROOT) -> dict[str, str]:
    """`canvasroute.<name>` -> its folder (the package itself left out)."""
    return {name: name for name in LAYERS if (root / name / "__init__.py").is_file()}


def build(root: Path = ROOT) -> Path:
    """Check, or repair, the links of the checkout at `root`; return its import root (idempotent)."""
    links = {root / "canvasroute" / name: Path("..") / folder for name, folder in layers(root).items()}
    links[root / "src" / "canvasroute"] = Path("..") / "canvasroute"
    for link, target in links.items():
        if not (link.is_symlink() and link.resolve() == (link.parent / target).resolve()):
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.is_file():
                link.unlink()
            link.symlink_to(target)
    return root / "src"


if __name__ == "__main__":
    sys.stdout.write(f"{build()}\n")
