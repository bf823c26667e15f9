"""Build `.canvasroute/import-root`: a folder in which `canvasroute` is this checkout, as the wheel lays it out.

The layer folders sit at the top of the repository and pyproject.toml's `package-dir` maps them
beneath `canvasroute`. The import root is that mapping as symlinks, so `canvasroute` imports from a
checkout without installing it: tests/conftest.py puts it first on `sys.path` (and on every child
process's PYTHONPATH), and scripts/check.sh runs mypy in it (`mypy -p canvasroute`).

Usage: `python scripts/import_root.py` builds (or repairs) it and prints its path. Standard library only.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layers(root: Path = ROOT) -> dict[str, str]:
    """`canvasroute.<name>` -> its folder, from pyproject.toml's `package-dir` (the package itself left out)."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("canvasroute."): folder for name, folder in package_dir.items() if name != "canvasroute"}


def build(root: Path = ROOT) -> Path:
    """Create or repair the import root of the checkout at `root`; return it (idempotent, links only)."""
    out = root / ".canvasroute" / "import-root"
    package = out / "canvasroute"
    package.mkdir(parents=True, exist_ok=True)
    links = {entry.name: entry for entry in (root / "canvasroute").iterdir() if entry.name != "__pycache__"}
    links |= {name: root / folder for name, folder in layers(root).items()}
    for name, target in links.items():
        link = package / name
        if not (link.is_symlink() and link.resolve() == target.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return out


if __name__ == "__main__":
    sys.stdout.write(f"{build()}\n")
