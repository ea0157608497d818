"""The layers the code keeps: data flows one way, and no module imports from a later stage.

Every import in ``src/fedattr`` is read with ``ast`` (lazy ones inside functions included) and
checked against the stage of the importing package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Stage of each top-level part of the package: a module may import its own package and any
# package of a lower stage; packages of one stage do not import each other.
STAGES: dict[str, int] = {
    "__init__": 0,
    "errors": 0,
    "runtime": 1,
    "updates": 1,
    "config": 1,
    "linalg": 1,
    "rows": 1,
    "secagg": 2,
    "data": 2,
    "models": 3,
    "watermarks": 4,
    "fl": 5,
    "attribution": 6,
    "baselines": 7,
    "reporting": 8,
    "pipeline": 9,
    "experiments": 10,
    "flower": 10,
    "owner": 10,
    "cli": 11,
    "__main__": 12,
}


def _part(module: str) -> str:
    """``fedattr.attribution.offline`` -> ``attribution``; ``fedattr`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path, src: Path) -> tuple[str, str]:
    """The module name of ``path`` and the package its relative imports start from."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _is_module(src: Path, module: str) -> bool:
    path = src.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path, src: Path) -> list[tuple[int, str]]:
    """Every ``fedattr`` module ``path`` imports, with its line, wherever the import stands."""
    _, package = _module_of(path, src)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                # ``from . import x``: x may be a module of that package, or a name in it.
                names = (
                    [target]
                    if node.module
                    else [
                        f"{target}.{a.name}" if _is_module(src, f"{target}.{a.name}") else target
                        for a in node.names
                    ]
                )
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "fedattr" or n.startswith("fedattr.")]
    return out


def violations(src: Path) -> list[str]:
    """Imports from a later stage or a sibling package of the same stage, one line each."""
    found = []
    for path in sorted((src / "fedattr").rglob("*.py")):
        module, _ = _module_of(path, src)
        here = _part(module)
        if here not in STAGES:
            found.append(f"{path.relative_to(src)}: package {here!r} has no stage in STAGES")
            continue
        for line, target in imports_of(path, src):
            there = _part(target)
            if there == here or there == "__init__":
                continue
            if there not in STAGES or STAGES[there] >= STAGES[here]:
                found.append(
                    f"{path.relative_to(src)}:{line}: {module} ({here}, stage "
                    f"{STAGES[here]}) imports {target} ({there}, stage "
                    f"{STAGES.get(there)})"
                )
    return found


def test_no_module_imports_from_a_later_stage():
    assert violations(SRC) == []


# Within a package whose modules are steps of one computation, the floor of each module: a
# module imports only modules of a lower floor of its package (the calibrated statistic: what
# a round goes through, from its plan to the verdict).
FLOORS: dict[str, dict[str, int]] = {
    "fedattr.attribution.calibrated": {
        "__init__": 0,
        "weights": 0,
        "crosstalk": 0,
        "plan": 1,
        "standardise": 2,
        "demix": 2,
        "verdict": 2,
        "sums": 3,
        "reading": 4,
    },
}


def floor_violations(src: Path) -> list[str]:
    """Imports within a package of :data:`FLOORS` that do not go to a lower floor."""
    found = []
    for package, floors in FLOORS.items():
        folder = src.joinpath(*package.split("."))
        modules = {p.stem for p in folder.glob("*.py")}
        if modules != set(floors):
            found.append(f"{package}: modules {sorted(modules)}, floors for {sorted(floors)}")
        for path in sorted(folder.glob("*.py")):
            here = floors.get(path.stem, -1)
            for line, target in imports_of(path, src):
                if not target.startswith(package + "."):
                    continue
                there = target[len(package) + 1 :].split(".")[0]
                if floors.get(there, 99) >= here:
                    found.append(f"{path.relative_to(src)}:{line}: floor {here} imports {target}")
    return found


def test_the_calibrated_statistic_reads_one_way():
    assert floor_violations(SRC) == []


def test_the_gls_stack_and_the_detector_contract_have_one_home_each():
    """The de-mixer and the cross-round audit share :mod:`fedattr.linalg`'s GLS stack (not the
    release policy's module); the detector protocols are defined in one module."""
    for path in (SRC / "fedattr/attribution").rglob("*.py"):
        targets = [t for _, t in imports_of(path, SRC)]
        assert "fedattr.secagg.policy" not in targets or path.stem in ("audit", "privacy"), path
        if path.stem != "contract":
            tree = ast.parse(path.read_text())
            protocols = [
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)
                and any(getattr(b, "id", None) == "Protocol" for b in n.bases)
            ]
            assert protocols == [], (path, protocols)


def test_every_package_has_a_stage():
    parts = {
        p.stem if p.is_file() else p.name
        for p in (SRC / "fedattr").iterdir()
        if (p.suffix == ".py") or (p / "__init__.py").is_file()
    }
    assert parts == set(STAGES)


def test_a_planted_back_import_is_caught_lazy_or_relative(tmp_path):
    pkg = tmp_path / "fedattr"
    for sub in ("attribution", "owner", "secagg", "data"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "owner" / "score.py").write_text("from ..attribution import protocol\n")
    (pkg / "attribution" / "offline.py").write_text(
        "def attribute():\n    from ..owner.score import x\n    import fedattr.owner\n"
    )
    (pkg / "secagg" / "base.py").write_text("from ..data import corpus\n")
    found = violations(tmp_path)
    assert len(found) == 3, found
    assert (
        sum(
            "fedattr.attribution.offline (attribution, stage 6) imports fedattr.owner" in f
            for f in found
        )
        == 2
    )
    assert any("imports fedattr.data (data, stage 2)" in f for f in found)  # same stage
