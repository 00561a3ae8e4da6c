"""The layout holds: imports run one way through the layers of ``sim/``, no package has an import
cycle (imports inside functions included), and functions stay small.

Each check is also run on a small package written here with the fault in it, to show it fails.
"""

import ast
from pathlib import Path

import numpy as np
import pytest
from import_graph import cycles, import_graph, layer_of, project_modules, upward_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "calibrate", "validation", "hfmodel")

# Lower numbers sit lower; a module may import its own package and lower layers only. Packages of
# one layer do not import each other (core, workload and hardware are independent; so are costs
# and scenario, and the two studies).
LAYERS = {
    "sim": 0,
    "sim.errors": 0,
    "sim.dtypes": 1,
    "sim.fileio": 1,
    "sim.childproc": 1,
    "sim.core": 2,
    "sim.workload": 2,
    "sim.hardware": 2,
    "sim.costs": 3,
    "sim.scenario": 3,
    "sim.schedule": 4,
    "sim.simulate": 5,
    "sim.outputs": 6,
    "sim.study.sweep": 7,
    "sim.study.tune": 7,
    "sim.study": 7,
    "sim.cli": 8,
}
FUNCTION_LINES_P95 = 40


def test_no_import_cycle_anywhere() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert graph.number_of_edges() > 100  # the graph really was read
    assert cycles(graph) == []


def test_sim_imports_run_down_the_layers() -> None:
    graph = import_graph(ROOT, ["sim"])
    assert upward_imports(graph, LAYERS) == []


def test_every_sim_module_has_a_layer() -> None:
    """A new module must be placed in a layer (a bare ``sim.x`` would escape the rule)."""
    loose = [
        m
        for m in project_modules(ROOT, ["sim"])
        if layer_of(m, LAYERS) == 0 and m not in ("sim", "sim.errors")
    ]
    assert loose == []


def test_the_simulator_core_imports_no_torch() -> None:
    offenders = []
    for path in (ROOT / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert offenders == []


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_found_even_through_an_import_inside_a_function(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import f\n",
            "pkg/b.py": "def f():\n    from pkg import a  # lazy, still a cycle\n    return a\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    (tmp_path / "pkg/b.py").write_text("def f():\n    import torch  # heavy, optional, outside the graph\n")
    assert cycles(import_graph(tmp_path, ["pkg"])) == []


def test_an_upward_import_and_a_sideways_one_are_found(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "sim/__init__.py": "",
            "sim/core/__init__.py": "",
            "sim/core/engine.py": "from sim.outputs import report\n",  # up
            "sim/workload/__init__.py": "",
            "sim/workload/model.py": "from sim.hardware.schema import X\n",  # sideways
            "sim/hardware/__init__.py": "",
            "sim/hardware/schema.py": "X = 1\n",
            "sim/outputs/__init__.py": "",
            "sim/outputs/report.py": "from sim.core import engine\n",  # down: allowed
        },
    )
    graph = import_graph(tmp_path, ["sim"])
    assert upward_imports(graph, LAYERS) == [
        ("sim.core.engine", "sim.outputs.report"),
        ("sim.workload.model", "sim.hardware.schema"),
    ]


def function_lengths(package: Path) -> list[int]:
    """Lines of every function and method of ``package`` (its docstring included)."""
    lengths = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths.append(node.end_lineno - node.lineno + 1)  # type: ignore[operator]
    return lengths


@pytest.mark.parametrize("package", PACKAGES)
def test_functions_stay_small(package: str) -> None:
    """STYLE.md: most functions under ~40 lines; the 95th percentile of each package at most 40."""
    lengths = function_lengths(ROOT / package)
    assert len(lengths) > 50
    assert float(np.percentile(lengths, 95)) <= FUNCTION_LINES_P95


def test_the_length_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    _write_package(
        tmp_path, {"pkg/long.py": f"def long():\n{body}\n", "pkg/short.py": "def short():\n    pass\n"}
    )
    assert sorted(function_lengths(tmp_path / "pkg")) == [2, 61]
