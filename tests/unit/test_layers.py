"""The import layers of docs/DESIGN.md ("Layers"), enforced: every import of every module under
shardtune/, parsed with `ast` at any depth (inside functions and `if TYPE_CHECKING:` blocks too: a
lazy import is still a dependency), checked against the table in DESIGN.md, the one copy of it.
Each test lists every offender in one message, so one run says all that is left to fix."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "shardtune"
DESIGN = ROOT / "docs" / "DESIGN.md"
MAX_LINES = 400
# What a torch-free row may not import (top-level names), as DESIGN.md "Layers" lists them.
HEAVY = {"torch", "transformers", "peft", "safetensors", "bitsandbytes", "accelerate", "numpy", "matplotlib"}
GLUE_ROW = "cli"  # cli.py, commands.py, *_commands.py, __main__.py sit here wherever they live


def _layer_table() -> dict[str, tuple[int, str, bool]]:
    """Row prefix (relative to shardtune, dotted) → (layer, row name, torch-free)."""
    text = DESIGN.read_text()
    start = text.index("<!-- layer table")
    rows: dict[str, tuple[int, str, bool]] = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[0].isdigit():
            continue  # the header and its rule
        names = re.findall(r"`([^`]+)`", cells[1])
        for name in names:
            rows[name] = (int(cells[0]), names[0], cells[3].lower() == "yes")
    assert rows, "no layer table found in docs/DESIGN.md"
    return rows


def _module_name(path: Path) -> str:
    """Dotted name relative to shardtune/; shardtune/__init__.py itself is `__init__`."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _is_glue(path: Path) -> bool:
    return path == PKG / "cli.py" or path.name in ("commands.py", "__main__.py") or path.name.endswith(
        "_commands.py")


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]):
    """(line, target) for each import: target is 'shardtune.<module>' resolved to a module that
    exists (`from a import b` names a.b when b is a module), or a third-party top-level name."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                base = ".".join(["shardtune", *package[: len(package) - node.level + 1]])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}".removeprefix("shardtune.") in modules else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "shardtune":
                yield node.lineno, "__init__"
            elif t.startswith("shardtune."):
                parts = t.removeprefix("shardtune.").split(".")
                while len(parts) > 1 and ".".join(parts) not in modules:
                    parts.pop()
                yield node.lineno, ".".join(parts)
            else:
                yield node.lineno, "!" + t.split(".")[0]  # third party / stdlib


def _row(module: str, path: Path | None, table) -> tuple[int, str, bool] | None:
    if path is not None and _is_glue(path):
        return table[GLUE_ROW]
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in table:
            return table[".".join(parts[:k])]
    return None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one row (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_imports_follow_the_layer_table():
    table, modules = _layer_table(), _modules()
    problems: list[str] = []
    row_edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        src = _row(module, path, table)
        where = path.relative_to(ROOT)
        if src is None:
            problems.append(f"unlisted: {where} matches no row of the layer table")
            continue
        layer, row, torch_free = src
        for line, target in sorted(set(_imports(path, modules))):
            if target.startswith("!"):
                if torch_free and target[1:] in HEAVY:
                    problems.append(f"heavy:    {where}:{line} imports {target[1:]} ({row} is torch-free)")
                continue
            dst = _row(target, modules.get(target), table)
            if dst is None:
                problems.append(f"unlisted: {where}:{line} imports shardtune.{target}, which matches no row")
                continue
            t_layer, t_row, _ = dst
            if t_row == row:
                continue
            row_edges.setdefault(row, set()).add(t_row)
            if t_layer > layer:
                problems.append(f"upward:   {where}:{line} imports shardtune.{target} "
                                f"({row}, layer {layer} -> {t_row}, layer {t_layer})")
            elif t_layer == layer:
                problems.append(f"sideways: {where}:{line} imports shardtune.{target} "
                                f"({row} and {t_row} share layer {layer})")
    problems += [f"cycle:    {' <-> '.join(c)}" for c in _cycles(row_edges)]
    if problems:
        pytest.fail("import layers broken (docs/DESIGN.md, Layers):\n  " + "\n  ".join(problems), pytrace=False)


def test_command_glue_holds_no_heavy_logic():
    """cli.py and the commands modules parse options and call a module of their area; what needs torch
    (loading a model, generating, training) lives there (train/generation.py for `shardtune
    generate`), so no glue imports a heavy library at any depth. __main__.py is a process's entry."""
    modules = _modules()
    heavy = [f"{path.relative_to(ROOT)}:{line} imports {target[1:]}" for path in modules.values()
             if _is_glue(path) and path.name != "__main__.py"
             for line, target in sorted(set(_imports(path, modules))) if target[1:] in HEAVY]
    assert not heavy, "command glue importing heavy libraries (move the logic out):\n  " + "\n  ".join(heavy)


def test_layer_table_names_rows_that_exist():
    table, modules = _layer_table(), _modules()
    missing = [name for name in table if name != GLUE_ROW and not any(
        m == name or m.startswith(name + ".") for m in modules)]
    assert not missing, f"layer table rows with no module under shardtune/: {missing}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    if long:
        pytest.fail(f"modules over {MAX_LINES} lines (docs/STYLE.md): " + ", ".join(
            f"{p} ({n})" for p, n in long.items()), pytrace=False)


# module cycles still to break: none since issue 28 broke the last three. A new cycle fails, and
# an entry here that no longer exists fails too, so the list only shrinks
KNOWN_MODULE_CYCLES: list[list[str]] = []


def test_no_new_module_import_cycles():
    """No two modules import each other, directly or round a loop, at any depth (lazy in-function
    imports included: a lazy import hides a cycle from Python, not from a reader)."""
    modules = _modules()
    edges = {m: {t for _, t in _imports(p, modules) if not t.startswith("!") and t != m}
             for m, p in modules.items()}
    found = _cycles(edges)
    assert sorted(found) == sorted(KNOWN_MODULE_CYCLES), f"module import cycles: {found}"


def test_the_launcher_side_imports_no_torch():
    """train/launcher/ runs in the `shardtune train` process before torchrun: importing every module
    of it (and the train command) loads no heavy library, so a bad input is one line in about a
    second, not a rank's traceback after torch's import."""
    import subprocess
    import sys

    names = ["shardtune.train.commands"] + sorted(
        f"shardtune.train.launcher.{p.stem}" for p in (PKG / "train" / "launcher").glob("*.py"))
    assert len(names) >= 6, names
    code = ("import importlib, json, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted(HEAVY)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the launcher side imports {out.stdout.strip()}"


# The trainer (train/, parallel/) and the planner (plan/) import neither each other (issue 38), their
# command glue included: what both need lives below them (rules/, layout.py, strategies.py, config/flags.py).
# The trainer's two entries (train/commands.py, train/__main__.py) get `shardtune.plan.plan` from the top
# (wiring.py) and hand it down as a function for plan.json and the memory check.
SEPARATED = (("train", "plan"), ("parallel", "plan"), ("plan", "train"), ("plan", "parallel"))


def test_trainer_and_planner_do_not_import_each_other():
    modules = _modules()
    inside = lambda m, pkg: m == pkg or m.startswith(pkg + ".")  # noqa: E731
    edges = [f"{p.relative_to(ROOT)}:{line} imports shardtune.{t}"
             for m, p in modules.items() for src, dst in SEPARATED
             if inside(m, src)
             for line, t in sorted(set(_imports(p, modules))) if inside(t, dst)]
    assert not edges, "trainer <-> planner imports (move the shared rule to rules/):\n  " + "\n  ".join(edges)


# Command modules (cli.py, */commands.py, *_commands.py) hold commands and their registration only
# (issue 38 item 4):
# a top-level function is a command (decorated with `.command(...)` / `.callback(...)`, or handed to
# one), `register`, or listed here with why it stays; a top-level assignment declares options
# (typer.Option / Argument / Typer), `__all__`, or is listed here. Logic goes to the area's modules.
COMMAND_MODULE_ALLOWED: dict[str, set[str]] = {
    # the CLI's own entry points and typer's presentation fix (cli.py is the glue itself)
    # the recipe and the options validated together, called by every launcher (its checks: launch/checks.py)
    "launch.commands": {"_build"},
    # the generated `shardtune plan` (options from config/plan_keys.py) and the glue it needs
    "plan.commands": {"_D", "_RENAMED", "_OWN_OPTIONS", "plan_cmd", "_build_plan_cmd", "_planner_option", "_param",
                      "_is_recipe", "recipe_inputs", "_given_on_command_line", "plan_input_values", "kept_fields",
                      "_plan", "_fit", "_print_catalogue"},
    # `shardtune train`'s options come from config/flags.py: the command and its parameters
    "train.commands": {"_train", "_param"},
    "cli": {"app", "COMMAND_MODULES", "_print_version", "_conventional_arguments", "_register_commands", "main",
            "console", "PATH_ERRNOS"},
}


def _registered(tree: ast.Module) -> set[str]:
    """Names decorated with `.command(...)` / `.callback(...)` or passed to a `.command(...)(name)` call."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if isinstance(f, ast.Attribute) and f.attr in ("command", "callback"):
                    out.add(node.name)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Call):
            f = node.func.func
            if isinstance(f, ast.Attribute) and f.attr == "command":
                out |= {a.id for a in node.args if isinstance(a, ast.Name)}
    return out


def _declares_options(value: ast.expr) -> bool:
    calls = [value] if isinstance(value, ast.Call) else []
    return bool(calls) and all(isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                               and c.func.value.id == "typer" for c in calls)


def test_command_modules_define_only_commands():
    offenders = []
    for name, path in _modules().items():
        if not _is_glue(path) or path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = _registered(tree) | {"register"} | COMMAND_MODULE_ALLOWED.get(name, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name not in allowed:
                    offenders.append(f"{name}:{node.lineno} {node.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if not (_declares_options(node.value) or set(names) <= allowed | {"__all__"}):
                    offenders.append(f"{name}:{node.lineno} {', '.join(names)}")
    assert not offenders, f"command modules define more than commands: {offenders}"
