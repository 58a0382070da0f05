"""The packages' order: a module imports only from its own package or from a
lower layer, never upward and never sideways (a package of the same layer).
Every import counts, the ones inside functions and under ``TYPE_CHECKING``
too. The root package ``kvtier`` is the public face (``kvtier.__all__``, loaded
lazily) and stays out of the order: any module may read ``kvtier.__version__``."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import kvtier

SOURCE = Path(kvtier.__file__).parent

# Lowest first. What each layer is for:
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "foundations",
        frozenset(
            {"units", "counters", "paths", "output", "extras", "reaper", "traces", "costfit"}
        ),
    ),
    ("settings and helpers", frozenset({"config", "failures", "models", "process"})),
    ("keys and layouts", frozenset({"keys", "layout", "read_or_recompute"})),
    ("tiers and their events", frozenset({"l1", "l2", "events"})),
    ("controllers between tiers", frozenset({"controllers"})),
    ("the storage facade", frozenset({"storage"})),
    ("contracts and reuse arithmetic", frozenset({"protocol", "blend"})),
    ("capacity planning", frozenset({"planner"})),
    ("tenancy", frozenset({"tenancy"})),
    ("server, engines, router", frozenset({"server", "engine", "router"})),
    ("operator plane", frozenset({"operations"})),
    ("benchmarks", frozenset({"bench"})),
    ("command line", frozenset({"commands"})),
    ("python -m kvtier", frozenset({"__main__"})),
)
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def sources(root: Path = SOURCE) -> dict[str, str]:
    """Every module's dotted name -> its source."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("kvtier", *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def imported(module: str, source: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each kvtier module or name ``module`` imports."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            yield node.lineno, name
            if name in ("kvtier", "") or name.count(".") == 0:
                continue
            for alias in node.names:  # "from kvtier.server import core" names a module
                yield node.lineno, f"{name}.{alias.name}"


def unit_of(name: str) -> str | None:
    """The top-level package or module of a kvtier name (None: not kvtier's,
    or the root package itself)."""
    parts = name.split(".")
    if parts[0] != "kvtier" or len(parts) == 1:
        return None
    return parts[1]


def violations(modules: Mapping[str, str], packages: frozenset[str]) -> list[str]:
    """One line per import that goes up or sideways, or touches a package
    with no layer."""
    found = []
    for module, source in sorted(modules.items()):
        own = unit_of(module)
        if own is None:
            continue  # the root package: the public face
        targets: dict[tuple[int, str], str] = {}  # (line, package) -> the module imported
        for line, name in imported(module, source, module in packages):
            target = unit_of(name)
            known = (line, target) in targets and name not in modules
            if target is not None and target != own and not known:
                targets[line, target] = name
        for (line, target), name in sorted(targets.items()):
            if own not in LAYER_OF or target not in LAYER_OF:
                missing = own if own not in LAYER_OF else target
                found.append(f"{module}:{line}: {missing!r} has no layer in LAYERS")
            elif LAYER_OF[target] >= LAYER_OF[own]:
                how = "sideways" if LAYER_OF[target] == LAYER_OF[own] else "upward"
                found.append(
                    f"{module}:{line} imports {name} ({how}: {LAYERS[LAYER_OF[own]][0]} "
                    f"-> {LAYERS[LAYER_OF[target]][0]})"
                )
    return found


def tree() -> tuple[dict[str, str], frozenset[str]]:
    packages = frozenset(
        ".".join(("kvtier", *p.parent.relative_to(SOURCE).parts)).rstrip(".")
        for p in SOURCE.rglob("__init__.py")
    )
    return sources(), packages


def test_every_import_goes_down_the_layers() -> None:
    modules, packages = tree()
    assert violations(modules, packages) == []


def test_every_package_has_a_layer() -> None:
    modules, _ = tree()
    units = {unit_of(m) for m in modules} - {None}
    assert units == set(LAYER_OF), "add the new package to LAYERS in its place"


def test_an_upward_import_is_found() -> None:
    modules, packages = tree()
    planted = dict(modules)
    planted["kvtier.keys.hasher"] += "\nfrom kvtier.server import core\n"
    found = violations(planted, packages)
    assert len(found) == 1
    assert "kvtier.keys.hasher" in found[0] and "kvtier.server.core" in found[0]
    assert "upward: keys and layouts -> server, engines, router" in found[0]


def test_a_sideways_import_is_found() -> None:
    modules, packages = tree()
    planted = dict(modules)
    lines = planted["kvtier.router.pd.proxy"].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("from kvtier"))
    lines.insert(first, "from kvtier.engine.vllm.handoff import handoff_params")
    planted["kvtier.router.pd.proxy"] = "\n".join(lines)
    found = violations(planted, packages)
    assert len(found) == 1 and "sideways" in found[0] and "kvtier.router.pd.proxy" in found[0]


def test_imports_inside_functions_and_for_types_count() -> None:
    modules, packages = tree()
    planted = dict(modules)
    planted["kvtier.l1.arena"] += (
        "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from kvtier.storage import StorageManager\n"
        "def later():\n    from kvtier.protocol import client\n"
    )
    found = violations(planted, packages)
    assert [("kvtier.storage" in f, "kvtier.protocol.client" in f) for f in found] == [
        (True, False),
        (False, True),
    ]
