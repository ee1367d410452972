"""The shipped recipes: `shardtune recipes` lists them, `shardtune recipes cp NAME DEST` copies one.

The repository's recipes/ is the source; `shipped/` is a link to it, which setuptools copies into
the wheel as package data (pyproject.toml), so an installed shardtune has them too."""
from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "shipped"


def recipe_files() -> dict[str, Path]:
    """name (file stem) → path of each shipped recipe, sorted by name."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def summary(path: Path) -> str:
    """The recipe's first comment paragraph (what it is), on one line."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("# ") or line.startswith("#  "):
            break
        words.append(line[2:].strip())
    return " ".join(words)


def list_recipes() -> str:
    """`shardtune recipes`' listing: each shipped recipe's name and what it is, then how to copy one."""
    files = recipe_files()
    width = max(map(len, files), default=4)
    lines = [f"{'RECIPE':<{width}}  WHAT"] + [f"{name:<{width}}  {summary(p)}" for name, p in files.items()]
    return "\n".join(lines + ["", "copy one to edit: shardtune recipes cp NAME my-recipe.yaml"])
