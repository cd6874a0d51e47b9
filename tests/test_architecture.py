"""The rooms stay apart: import rules checked on the import graph, read statically from every module.

Every ``import`` counts, at module level or inside a function (``if TYPE_CHECKING`` too: a
contract that points the wrong way in its types points the wrong way); ``from package import
name`` imports the submodule when ``name`` is one. The rules (issue 16; the map in edgert/__init__.py):

1. ``edgert.transport`` and ``edgert.models`` import nothing of edgert outside themselves but
   ``edgert.errors`` (the base error).
2. What a board's commands load holds no ``edgert.exporter``, ``edgert.coordinator``, ``edgert.bench``,
   ``onnx``, ``torch`` or ``sklearn``: for ``edgert worker``, ``edgert.worker``, the ``edgert.cli``
   package and the module its table ``COMMANDS`` names for the worker command, with everything they
   import; for ``edgert evaluate`` and ``edgert predict`` (a trained model used on a board), the
   ``edgert.cli`` package and their module. ``edgert.cli`` imports a command's module only when that
   command runs (edgert/cli/lazy_group.py), so the other commands' modules are not part of it.
3. The contract (``edgert/*.py`` and ``edgert/protocol/``) imports neither role, nor the exporter,
   benchmarks or CLI.
4. The worker, the coordinator, the contract and the transport never import ``edgert.bench``.

A broken rule fails with the offending import:
``edgert/schedule.py:36 imports edgert.worker.executor (the contract must not import a role)``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BOARD_FORBIDDEN = ("edgert.exporter", "edgert.coordinator", "edgert.bench", "onnx", "torch", "sklearn")
CONTRACT_FORBIDDEN = ("edgert.worker", "edgert.coordinator", "edgert.exporter", "edgert.bench", "edgert.cli")
BENCH_FREE = ("edgert.worker", "edgert.coordinator", "edgert.transport")  # and the contract
WORKER_COMMAND = "worker"
BOARD_COMMANDS = (WORKER_COMMAND, "evaluate", "predict")  # what a board runs: rule 2 holds for each


@dataclass(frozen=True)
class Import:
    """One import statement's target and where it is written (at module level or in a function)."""

    source: str
    path: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


@dataclass
class Module:
    name: str
    path: str  # relative to the repository, as messages show it
    is_package: bool
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)


def inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class ImportGraph:
    """Every module of the given packages (name -> folder) and the imports each one writes."""

    def __init__(self, packages: dict[str, Path], root: Path):
        self.modules: dict[str, Module] = {}
        for package, folder in packages.items():
            for file in sorted(folder.rglob("*.py")):
                parts = file.relative_to(folder).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                name = ".".join((package, *(parts[:-1] if is_package else parts)))
                tree = ast.parse(file.read_text(), str(file))
                self.modules[name] = Module(name, file.relative_to(root).as_posix(), is_package, tree)
        for module in self.modules.values():
            module.imports = list(self._imports(module))

    @classmethod
    def of_repository(cls) -> ImportGraph:
        tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later: the host's
        setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
        return cls({name: REPO / folder for name, folder in setuptools["package-dir"].items()}, REPO)

    def _imports(self, module: Module):
        package = module.name if module.is_package else module.name.rpartition(".")[0]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base for a in node.names]
            elif _is_import_call(node):
                targets = [node.args[0].value]
            else:
                continue
            for target in dict.fromkeys(targets):
                yield Import(module.name, module.path, node.lineno, target)

    def loads(self, target: str) -> list[str]:
        """The modules of this graph that importing ``target`` runs: its packages' ``__init__``, then it."""
        parts = target.split(".")
        return [name for name in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if name in self.modules]


def _is_import_call(node: ast.AST) -> bool:
    """``importlib.import_module("name")`` or ``__import__("name")`` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__") and isinstance(node.args[0].value, str)


# -- the CLI: which module holds the worker command ----------------------------------------------

def command_table(graph: ImportGraph) -> dict[str, tuple[str, str]]:
    """The table ``COMMANDS`` of ``edgert.cli``: each command's module and help."""
    return next(ast.literal_eval(statement.value) for statement in graph.modules["edgert.cli"].tree.body
                if isinstance(statement, ast.Assign) and [getattr(t, "id", None) for t in statement.targets]
                == ["COMMANDS"])


def command_module(graph: ImportGraph, command: str = WORKER_COMMAND) -> str:
    """The module ``edgert <command>`` runs from: its entry in the table ``COMMANDS`` of ``edgert.cli``."""
    return f"edgert.cli.{command_table(graph)[command][0]}"


def _is_command(statement: ast.stmt, command: str) -> bool:
    """Whether a ``@click.command("<command>")`` decorator names this function."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
               and d.args and isinstance(d.args[0], ast.Constant) and d.args[0].value == command
               for d in getattr(statement, "decorator_list", ()))


# -- the rules ------------------------------------------------------------------------------------

def contract_modules(graph: ImportGraph) -> list[str]:
    """``edgert/*.py`` and ``edgert/protocol/``: what both roles speak (not ``edgert/__init__``, ``__main__``)."""
    return [name for name, m in graph.modules.items()
            if (name.count(".") == 1 and inside(name, "edgert") and not m.is_package and name != "edgert.__main__")
            or inside(name, "edgert.protocol")]


def own_room_violations(graph: ImportGraph, package: str) -> list[str]:
    """Rule 1: ``package`` imports of edgert only itself and the base error."""
    return [f"{i} ({package} may import of edgert only itself and edgert.errors)"
            for name, m in graph.modules.items() if inside(name, package) for i in m.imports
            if inside(i.target, "edgert") and not inside(i.target, package) and i.target != "edgert.errors"]


def contract_violations(graph: ImportGraph) -> list[str]:
    """Rule 3: the contract imports neither role, nor the exporter, the benchmarks or the CLI."""
    return [f"{i} (the contract must not import {_reason(forbidden)})"
            for name in contract_modules(graph) for i in graph.modules[name].imports
            for forbidden in CONTRACT_FORBIDDEN if inside(i.target, forbidden)]


def bench_violations(graph: ImportGraph) -> list[str]:
    """Rule 4: benchmarks sit beside the runtime and the wire, never inside."""
    runtime = [n for n in graph.modules if any(inside(n, p) for p in BENCH_FREE)] + contract_modules(graph)
    return [f"{i} (the runtime and the wire must not import benchmarks)"
            for name in runtime for i in graph.modules[name].imports if inside(i.target, "edgert.bench")]


def board_commands(graph: ImportGraph) -> list[str]:
    """The board's commands (BOARD_COMMANDS) the table ``COMMANDS`` of ``edgert.cli`` has."""
    table = command_table(graph)
    return [command for command in BOARD_COMMANDS if command in table]


def board_violations(graph: ImportGraph) -> list[str]:
    """Rule 2: what each board command (and ``edgert.worker``) loads holds none of BOARD_FORBIDDEN."""
    return list(dict.fromkeys(v for command in board_commands(graph) for v in board_closure(graph, command)[1]))


def board_closure(graph: ImportGraph, command: str = WORKER_COMMAND) -> tuple[dict[str, str | None], list[str]]:
    """The modules ``edgert <command>`` loads (each with the module that first imported it) and the forbidden imports.

    The roots: ``python -m edgert``, the ``edgert.cli`` package and the command's module; for the worker,
    all of ``edgert.worker`` too.
    """
    entry = [n for n in ("edgert.__main__", "edgert.cli", command_module(graph, command)) if n in graph.modules]
    workers = [n for n in graph.modules if inside(n, "edgert.worker")] if command == WORKER_COMMAND else []
    roots = workers + entry
    came_from: dict[str, str | None] = {name: None for name in roots}
    queue, violations = deque(roots), []
    while queue:
        module = queue.popleft()
        for i in graph.modules[module].imports:
            forbidden = [f for f in BOARD_FORBIDDEN if inside(i.target, f)]
            if forbidden:
                path = " -> ".join(_chain(came_from, module))
                violations.append(f"{i} (edgert {command} must not load {forbidden[0]}; loaded through {path})")
                continue
            for name in graph.loads(i.target):
                if name not in came_from:
                    came_from[name] = module
                    queue.append(name)
    return came_from, violations


def _chain(came_from: dict[str, str | None], module: str) -> list[str]:
    chain = [module]
    while came_from[chain[-1]] is not None:
        chain.append(came_from[chain[-1]])
    return chain[::-1]


def _reason(forbidden: str) -> str:
    return "a role" if forbidden in ("edgert.worker", "edgert.coordinator") else forbidden


# -- the repository keeps the rules ---------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph.of_repository()


def test_the_graph_covers_every_package(graph):
    tomllib = pytest.importorskip("tomllib")
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert set(packages) <= {name for name, m in graph.modules.items() if m.is_package}
    assert {"edgert.protocol", "edgert.worker.worker", "edgert.transport.codec"} <= set(graph.modules)
    assert board_commands(graph) == list(BOARD_COMMANDS)
    for command in BOARD_COMMANDS:
        modules = [name for name, m in graph.modules.items() if inside(name, "edgert.cli")
                   for s in m.tree.body if _is_command(s, command)]
        assert modules == [command_module(graph, command)]  # the closure starts there


@pytest.mark.parametrize("package", ["edgert.transport", "edgert.models"])
def test_transport_and_models_import_only_the_base_error(graph, package):
    assert own_room_violations(graph, package) == []


@pytest.mark.parametrize("command", BOARD_COMMANDS)
def test_a_board_command_loads_no_host_code(graph, command):
    assert board_closure(graph, command)[1] == []


def test_the_contract_imports_no_role(graph):
    assert contract_violations(graph) == []


def test_the_runtime_imports_no_benchmark(graph):
    assert bench_violations(graph) == []


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A zoo model and the inputs evaluate and predict read on a board: an .npz data set, an .npy of samples."""
    from edgert.models import build_model, save_model

    folder = tmp_path_factory.mktemp("served")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    rng = np.random.default_rng(0)
    np.savez(folder / "data.npz", x=rng.random((40, 64), np.float32), y=np.arange(40) % 10)
    np.save(folder / "x.npy", rng.random((3, 64), np.float32))
    return folder


BOARD_RUNS = {  # each board command run for real, as a board runs it
    "worker": ["worker", "--help"],
    "evaluate": ["evaluate", "{folder}/mlp.onnx", "--data", "{folder}/data.npz"],
    "predict": ["predict", "{folder}/mlp.onnx", "{folder}/x.npy"],
}


@pytest.mark.parametrize("command", BOARD_COMMANDS)
def test_the_static_closure_holds_what_a_board_command_really_loads(graph, served, command):
    """The static closure is no guess: a process that runs the command loads nothing outside it."""
    reached, _ = board_closure(graph, command)
    argv = [arg.format(folder=served) for arg in BOARD_RUNS[command]]
    code = ("import sys\nfrom edgert.cli import main\nimport edgert.worker.worker, edgert.worker.readiness\n"
            if command == WORKER_COMMAND else "import sys\nfrom edgert.cli import main\n")
    code += (f"sys.argv = {['edgert', *argv]!r}\n"
             "try:\n    main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
             "print('MODULES', *sorted(m for m in sys.modules if m.split('.')[0] in "
             "('edgert', 'onnx', 'torch', 'sklearn')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.partition("MODULES")[2].split())
    assert {m for m in loaded if not m.startswith("edgert")} == set()
    assert loaded - set(reached) - {"edgert"} == set()
    if command != WORKER_COMMAND:
        assert "edgert.inference.model" in loaded  # it ran, not only its help


def test_the_command_line_loads_a_command_only_when_it_runs():
    """``edgert --help`` lists every command of the table and imports none; each loads from the module named."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom edgert.cli import main\n"
            "print(CliRunner().invoke(main, ['--help']).output)\n"
            "print('MODULES', *sorted(m for m in sys.modules if m.startswith('edgert.cli.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    listing, _, loaded = result.stdout.partition("MODULES")
    assert result.returncode == 0 and loaded.split() == ["edgert.cli.lazy_group"], result.stdout + result.stderr
    from edgert.cli import COMMANDS, main

    for name, (module, text) in COMMANDS.items():
        command = main.get_command(click.Context(main), name)
        assert (f"  {name} " in listing, command.callback.__module__, command.help) == (
            True, f"edgert.cli.{module}", text)


# -- each rule can fail: a fake repository breaking one rule at a time ----------------------------

CLEAN = {
    "edgert/__init__.py": "",
    "edgert/errors.py": "class EdgertError(Exception): ...\n",
    "edgert/protocol.py": "from edgert.errors import EdgertError\nfrom . import schedule\n",
    "edgert/schedule.py": "import numpy\n",
    "edgert/worker/__init__.py": "",
    "edgert/worker/executor.py": "from edgert import schedule\nfrom edgert.protocol import EdgertError\n",
    "edgert/coordinator/__init__.py": "",
    "edgert/coordinator/run.py": "import onnx\nfrom edgert.exporter import plan\n",
    "edgert/bench/__init__.py": "",
    "edgert/bench/faults.py": "from edgert.worker import executor\n",
    "edgert/cli/__init__.py": textwrap.dedent("""\
        import importlib
        from edgert.cli import lazy_group

        COMMANDS = {"evaluate": ("inference", "Score a model."), "train": ("train", "Train a plan."),
                    "worker": ("worker", "Run a stage.")}

        def load(name):
            return importlib.import_module(f"edgert.cli.{COMMANDS[name][0]}")
        """),
    "edgert/cli/lazy_group.py": "import click\n",
    "edgert/cli/params.py": "class Url:\n    def convert(self):\n        from edgert.transport import urls\n",
    "edgert/cli/worker.py": textwrap.dedent("""\
        import click
        from edgert.cli.params import Url

        @click.command("worker", type=Url())
        def worker_command():
            from edgert.worker.executor import run
            _helper()

        def _helper():
            import numpy
        """),
    "edgert/cli/train.py": "from edgert.coordinator import run\nimport onnx\n",
    "edgert/cli/inference.py": textwrap.dedent("""\
        import click

        @click.command("evaluate")
        def evaluate_command():
            from edgert.models import data
        """),
    "transport/__init__.py": "",
    "transport/urls.py": "from edgert.errors import EdgertError\nfrom .codec import codec\n",
    "transport/codec.py": "",
    "exporter/__init__.py": "",
    "exporter/plan.py": "import onnx\n",
    "models/__init__.py": "",
    "models/mlp.py": "import onnx\nfrom edgert.models import errors\n",
    "models/errors.py": "from edgert.errors import EdgertError\n",
    "models/data.py": "import numpy\nfrom edgert.models import errors\n",
}
PACKAGES = {"edgert": "edgert", "edgert.exporter": "exporter", "edgert.transport": "transport",
            "edgert.models": "models"}


def fake_graph(tmp_path: Path, changes: dict[str, str]) -> ImportGraph:
    for name, text in {**CLEAN, **changes}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return ImportGraph({package: tmp_path / folder for package, folder in PACKAGES.items()}, tmp_path)


def all_violations(graph: ImportGraph) -> list[str]:
    return (own_room_violations(graph, "edgert.transport") + own_room_violations(graph, "edgert.models")
            + board_violations(graph) + contract_violations(graph) + bench_violations(graph))


def test_the_clean_fake_repository_keeps_every_rule(tmp_path):
    graph = fake_graph(tmp_path, {})
    assert all_violations(graph) == []
    reached, _ = board_closure(graph)
    # from-imports of submodules, relative imports, the worker command's helpers, a param type's method
    assert {"edgert.schedule", "edgert.protocol", "edgert.cli.lazy_group", "edgert.cli.params",
            "edgert.transport.urls", "edgert.transport.codec"} <= set(reached)
    assert not {"edgert.cli.train", "edgert.coordinator.run"} & set(reached)  # loaded only when train runs
    assert "edgert.models.data" not in reached
    assert {"edgert.cli.inference", "edgert.models.data"} <= set(board_closure(graph, "evaluate")[0])


@pytest.mark.parametrize("file,text,violation", [
    ("transport/codec.py", "def f():\n    from edgert.worker.executor import run\n",
     "transport/codec.py:2 imports edgert.worker.executor (edgert.transport may import of edgert only itself "
     "and edgert.errors)"),
    ("models/mlp.py", "from edgert import protocol\n",
     "models/mlp.py:1 imports edgert.protocol (edgert.models may import of edgert only itself and edgert.errors)"),
    ("edgert/schedule.py", "import os\nfrom edgert.worker import executor\n",
     "edgert/schedule.py:2 imports edgert.worker.executor (the contract must not import a role)"),
    ("edgert/schedule.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import edgert.coordinator.run\n",
     "edgert/schedule.py:3 imports edgert.coordinator.run (the contract must not import a role)"),
    ("edgert/protocol.py", "def report():\n    from edgert.cli.worker import worker_command\n",
     "edgert/protocol.py:2 imports edgert.cli.worker (the contract must not import edgert.cli)"),
    ("edgert/worker/executor.py", "from ..coordinator import run\n",
     "edgert/worker/executor.py:1 imports edgert.coordinator.run (edgert worker must not load edgert.coordinator; "
     "loaded through edgert.worker.executor)"),
    ("edgert/coordinator/run.py", "from edgert.bench.faults import inject\n",
     "edgert/coordinator/run.py:1 imports edgert.bench.faults (the runtime and the wire must not import "
     "benchmarks)"),
    ("edgert/worker/executor.py", "def run():\n    import torch.nn\n",
     "edgert/worker/executor.py:2 imports torch.nn (edgert worker must not load torch; loaded through "
     "edgert.worker.executor)"),
    ("edgert/protocol.py", "import importlib\nimportlib.import_module('sklearn.linear_model')\n",
     "edgert/protocol.py:2 imports sklearn.linear_model (edgert worker must not load sklearn; loaded through "
     "edgert.worker.executor -> edgert.protocol)"),
    ("edgert/cli/params.py", "class Url:\n    def convert(self):\n        from edgert.exporter.plan import p\n",
     "edgert/cli/params.py:3 imports edgert.exporter.plan (edgert worker must not load edgert.exporter; loaded "
     "through edgert.cli.worker -> edgert.cli.params)"),
    ("edgert/cli/worker.py", CLEAN["edgert/cli/worker.py"].replace("import numpy", "import onnx"),
     "edgert/cli/worker.py:10 imports onnx (edgert worker must not load onnx; loaded through edgert.cli.worker)"),
    ("edgert/cli/worker.py", CLEAN["edgert/cli/worker.py"] + "from edgert.cli.train import summary\n",
     "edgert/cli/train.py:1 imports edgert.coordinator.run (edgert worker must not load edgert.coordinator; "
     "loaded through edgert.cli.worker -> edgert.cli.train)"),
    ("edgert/cli/__init__.py", CLEAN["edgert/cli/__init__.py"] + "from edgert.cli import train\n",
     "edgert/cli/train.py:2 imports onnx (edgert worker must not load onnx; loaded through edgert.cli -> "
     "edgert.cli.train)"),
    ("models/data.py", "def digits():\n    from sklearn.datasets import load_digits\n",
     "models/data.py:2 imports sklearn.datasets (edgert evaluate must not load sklearn; loaded through "
     "edgert.cli.inference -> edgert.models.data)"),
    ("edgert/cli/__init__.py", CLEAN["edgert/cli/__init__.py"].replace('"worker": ("worker"', '"worker": ("train"'),
     "edgert/cli/train.py:1 imports edgert.coordinator.run (edgert worker must not load edgert.coordinator; "
     "loaded through edgert.cli.train)"),
])
def test_each_rule_names_the_offending_import(tmp_path, file, text, violation):
    violations = all_violations(fake_graph(tmp_path, {file: text}))
    assert any(v.startswith(violation) for v in violations), violations
