"""The architecture, measured from the code: each layer imports only downward (the real import graph, function-level
imports included, against a table of allowed edges), nothing reads another module's private names, and importing the
package changes nothing but Lightning's ``StrategyRegistry``.

The shape checks read the source with :mod:`ast`; the import checks run real interpreters. A failing check lists
every offending place as ``path:line``.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.machine import lacking

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_smartinf"
CORE = PACKAGE / "core"

#: What no module below the Lightning layer may import: the training frameworks it is driven by.
FRAMEWORKS = ("lightning", "lightning_utilities", "pytorch_lightning", "deepspeed")

#: Each module's part of the package, by the longest prefix of its name that is listed (docs/architecture.md).
PARTS = {
    "lightning_smartinf.core": "core",
    "lightning_smartinf.devices": "devices",
    "lightning_smartinf.devices.cpu": "devices.cpu",
    "lightning_smartinf.devices.xrt": "devices.xrt",
    "lightning_smartinf.devices.remote": "devices.remote",
    "lightning_smartinf.zero": "zero",
    "lightning_smartinf.plan": "plan",
    "lightning_smartinf.activations": "activations",
    "lightning_smartinf.lightning": "lightning",
    "lightning_smartinf.hf": "lightning",
    "lightning_smartinf.__init__": "entry",
    "lightning_smartinf.__main__": "entry",
    "lightning_smartinf.commands": "entry",
}

#: The parts each part may import (besides itself), function-level imports included: each layer imports only
#: downward, and a device kind only the core (the remote server hosts the ``cpu`` kind's devices).
ALLOWED = {
    "core": set(),
    "devices.cpu": {"core"},
    "devices.xrt": {"core"},
    "devices.remote": {"core", "devices.cpu"},
    "devices": {"devices.cpu", "devices.xrt", "devices.remote"},
    "zero": {"core"},
    "plan": {"core", "devices.cpu", "devices.remote", "activations"},
    "activations": {"core"},
    "lightning": {"core", "devices", "zero", "plan", "activations"},
    "entry": {"core", "devices", "devices.cpu", "devices.remote", "zero", "plan", "activations", "lightning"},
}
#: The parts that must not import a training framework.
FRAMEWORK_FREE = ("core", "devices", "devices.cpu", "devices.xrt", "devices.remote", "plan", "activations")

#: The places allowed to use names private to another module, by path relative to the package; ``None``: any name.
PRIVATE_NAME_EXCEPTIONS: dict[str, frozenset[str] | None] = {
    # The ZeRO adapter subclasses DeepSpeed's ZeRO-3 optimizer and calls its private methods; this one module does.
    "zero/optimizer.py": None,
    # The fused Adam/AdamW kernels that torch.optim's own `fused=True` path calls: the devices run the same kernel,
    # so their updates match torch's bit for bit.
    "core/rules.py": frozenset({"_fused_adam_", "_fused_adamw_"}),
    # A rank added since a checkpoint was saved loads rank 0's module states: DeepSpeed names the file it looks for
    # in these two methods of its engine, which the load wraps.
    "zero/safe_load.py": frozenset({"_get_all_ckpt_names", "_get_ckpt_name"}),
    # ZeRO's linear function records on its autograd context whether forward ran under autocast; the subclass whose
    # backward computes weight gradients in the gradient buffer reads it to do so only where ZeRO's would not cast.
    "zero/linear.py": frozenset({"_fwd_used_autocast"}),
    # The Lightning adapter that runs Lightning's DeepSpeedStrategy on DeepSpeed's CPU accelerator replaces exactly
    # the private steps that refuse CPUs; this one module calls them.
    "lightning/cpu_support.py": frozenset({"_init_deepspeed_distributed"}),
    # `model_sharded_context` replaces Lightning's, which formats the DeepSpeed config (the batch size from the
    # dataloader) before `zero.Init` reads it; it must do the same.
    "lightning/strategy.py": frozenset({"_init_config_if_needed"}),
    # Streaming pretrained weights into ZeRO-3 partitions builds the model as transformers' own loader does: a
    # concrete model class's `_from_config` (auto classes call it), and `_is_hf_initialized`, transformers' flag for
    # "loaded: do not initialise", on what the checkpoint filled.
    "hf/loading.py": frozenset({"_from_config", "_is_hf_initialized"}),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def _source(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text, filename=str(path))


def _walk(path: Path) -> list[ast.AST]:
    """Every node of the module, in the order of the source."""
    nodes = [node for node in ast.walk(_source(path)[1]) if hasattr(node, "lineno")]
    return sorted(nodes, key=lambda node: (node.lineno, node.col_offset))


def _modules(root: Path = PACKAGE) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names of the modules ``node`` imports from: ``from a import b`` is ``a.b`` where that is a
    module of this repository, ``a`` otherwise."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = _module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if _is_package_module(f"{base}.{a.name}") else base for a in node.names]


def _imports(path: Path) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of the module, those inside functions included, with each module it imports from."""
    for node in _walk(path):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module in dict.fromkeys(_imported_modules(path, node)):
                yield node, module


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# ------------------------------------------------------------------------------------------------------ layers


def part_of(module: str) -> str | None:
    """The part of the package ``module`` belongs to (``None``: not this package's)."""
    if module == "lightning_smartinf":
        return PARTS["lightning_smartinf.__init__"]
    matches = [p for p in PARTS if module == p or module.startswith(p + ".")]
    return PARTS[max(matches, key=len)] if matches else None


def _edges() -> Iterator[tuple[Path, ast.AST, str, str, str]]:
    """``(path, node, module imported, importing part, imported part)`` for every import of a module of this
    package, at any depth of the source."""
    for path in _modules():
        name = _module_name(path)
        source = part_of("lightning_smartinf.__init__" if name == "lightning_smartinf" else name)
        for node, module in _imports(path):
            target = part_of(module)
            if source is not None and target is not None:
                yield path, node, module, source, target


def test_every_module_belongs_to_a_listed_part() -> None:
    assert all(part_of(_module_name(path)) in ALLOWED for path in _modules())


def test_each_part_imports_only_the_parts_below_it() -> None:
    found = [
        f"{_where(path, node)} ({source}) imports {module} ({target})"
        for path, node, module, source, target in _edges()
        if target != source and target not in ALLOWED[source]
    ]
    assert not found, "imports against the table of allowed edges (docs/architecture.md):\n" + "\n".join(found)


def test_only_the_lightning_layer_and_the_zero_adapter_import_the_training_frameworks() -> None:
    found = [
        f"{_where(path, node)} imports {module}"
        for path in _modules()
        if part_of(_module_name(path)) in FRAMEWORK_FREE
        for node, module in _imports(path)
        if _within(module, FRAMEWORKS)
    ]
    assert not found, "a framework-free part imports a training framework:\n" + "\n".join(found)


def test_no_core_module_names_a_device_kind() -> None:
    """The core asks a device kind what it can do; it never compares ``backend`` with a kind's name."""
    kinds = ("'cpu'", "'xrt'", "'remote'", '"cpu"', '"xrt"', '"remote"')
    found = [
        f"{_where(path, node)} {ast.unparse(node)}"
        for path in _modules(CORE)
        for node in _walk(path)
        if isinstance(node, ast.Compare)
        and "backend" in ast.unparse(node)
        and any(k in ast.unparse(node) for k in kinds)
    ]
    assert not found, "the core branches on a device kind's name:\n" + "\n".join(found)


#: Inside the core, what each of its packages may import from the others (modules directly in ``core/`` are the
#: shared base: the ``Backend`` contract, rules, compression, settings, placement, the controller). The top is
#: ``build.py``, the one place that wraps a backend in tiers, and the core's ``__init__``, which re-exports.
CORE_ALLOWED = {
    "io": set(),
    "format": {"io", "base"},
    "base": {"io", "format"},
    "streaming": {"io", "format", "base"},
    "tiers": {"io", "format", "base", "streaming"},
    "top": {"io", "format", "base", "streaming", "tiers"},
}


def core_part_of(module: str) -> str:
    """``io``, ``format``, ``base``, ``streaming``, ``tiers`` or ``top``: the part of the core ``module`` is in."""
    name = module.removeprefix("lightning_smartinf.core").lstrip(".").split(".")[0]
    if name in ("", "build"):
        return "top"
    return name if name in CORE_ALLOWED else "base"


def test_inside_the_core_each_package_imports_only_downward() -> None:
    """The streaming base never knows the tiers that wrap it, and the on-disk format and I/O know no backend kind."""
    found = []
    for path in _modules(CORE):
        source = core_part_of(_module_name(path))
        for node, module in _imports(path):
            if not _within(module, ("lightning_smartinf.core",)) or module == "lightning_smartinf.core":
                continue
            target = core_part_of(module)
            if target != source and target not in CORE_ALLOWED[source]:
                found.append(f"{_where(path, node)} (core.{source}) imports {module} (core.{target})")
    assert not found, "imports against the core's table (docs/architecture.md):\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------------------ cycles


def _type_only_lines(path: Path) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: imports there never run."""
    lines: set[int] = set()
    for node in ast.walk(_source(path)[1]):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.body:
                lines.update(n.lineno for n in ast.walk(statement) if hasattr(n, "lineno"))
    return lines


def runtime_import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it runs (function-level imports included, type-only ones
    not); a package counts as its ``__init__``."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        name, skipped = _module_name(path), _type_only_lines(path)
        graph[name] = {
            module
            for node, module in _imports(path)
            if node.lineno not in skipped
            and _within(module, ("lightning_smartinf",))
            and module != name
            and _is_package_module(module)
        }
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_runtime_import_cycle() -> None:
    """Helpers take what they need, not the module above them: no two modules import each other, even through
    others or inside functions (type-only imports aside)."""
    cycles = import_cycles(runtime_import_graph())
    assert not cycles, "runtime import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


# ---------------------------------------------------------------------------------------------- private names


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines for itself: functions, classes, globals, class attributes, ``self.``/``cls.``
    attributes it assigns and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return {name for name in names if _is_private(name)}


def _private_uses(path: Path) -> Iterator[tuple[ast.AST, str, str]]:
    """``(node, name, description)`` for each use of a name private to another module."""
    own = _defined_names(_source(path)[1])
    for node in _walk(path):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for part in module.split("."):
                if _is_private(part):
                    yield node, part, f"imports from the private module {module}"
            for alias in node.names:
                if _is_private(alias.name):
                    yield node, alias.name, f"from {'.' * node.level}{module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    if _is_private(part):
                        yield node, part, f"import {alias.name}"
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
            yield node, node.attr, f"{ast.unparse(node.value)}.{node.attr}"


def test_no_module_uses_another_modules_private_names() -> None:
    found = []
    for path in _modules():
        allowed = PRIVATE_NAME_EXCEPTIONS.get(path.relative_to(PACKAGE).as_posix(), frozenset())
        if allowed is None:
            continue
        found += [f"{_where(path, node)} {what}" for node, name, what in _private_uses(path) if name not in allowed]
    assert not found, "uses of names private to another module:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------------- imports

#: Where ``scripts/setup.sh`` pre-builds DeepSpeed's ops: the environment's ``torch_extensions`` (resolved, as the
#: kernel names mapped files).
PREBUILT_OPS = (Path(sys.prefix) / "torch_extensions").resolve()

#: Prints the JIT-built extensions mapped into the process (Linux: /proc/self/maps) after the code before it.
PRINT_LOADED_EXTENSIONS = """
with open("/proc/self/maps") as maps:
    loaded = {line.split(None, 5)[-1].strip() for line in maps if line.rstrip().endswith(".so")}
for path in sorted(loaded):
    if "torch_extensions" in path:
        print("EXTENSION", path)
"""


_NOT_INHERITED = {
    "TORCH_EXTENSIONS_DIR",
    *("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"),
}


def _python(code: str, cache: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``TORCH_EXTENSIONS_DIR`` unset, as a first run of a user is.

    Its cache is ``cache``: torch builds an op it finds nowhere under ``cache/torch_extensions``, not under ``~``.
    """
    # Without this process's extension directory, and without the rendezvous of fits run in it (MASTER_PORT, ranks).
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.update(XDG_CACHE_HOME=str(cache), PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _loaded_extensions(done: subprocess.CompletedProcess[str]) -> list[Path]:
    return [Path(line.split(None, 1)[1]) for line in done.stdout.splitlines() if line.startswith("EXTENSION ")]


def _assert_prebuilt(loaded: list[Path], cache: Path) -> None:
    elsewhere = [str(p) for p in loaded if not p.is_relative_to(PREBUILT_OPS)]
    assert not elsewhere, f"ops loaded from outside {PREBUILT_OPS}:\n" + "\n".join(elsewhere)
    assert not (cache / "torch_extensions").exists(), f"an op was built under {cache / 'torch_extensions'}"


@pytest.mark.slow
def test_import_changes_no_environment_variable_and_registers_the_strategy(tmp_path: Path) -> None:
    # Lightning's own import sets variables of its own (PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_CACHE_DIR);
    # what the package's import changes is measured after it.
    _python(
        "import os\n"
        "import lightning.pytorch\n"
        "before = dict(os.environ)\n"
        "import lightning_smartinf\n"
        "changed = {k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)}\n"
        "assert not changed, f'import lightning_smartinf changed {sorted(changed)}'\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'smart_infinity' in StrategyRegistry\n",
        tmp_path,
    )


@pytest.mark.slow
def test_the_strategy_is_registered_when_lightning_is_imported_after_the_package(tmp_path: Path) -> None:
    """`import lightning_smartinf` first imports neither Lightning nor DeepSpeed (the server and the planner need
    neither); `Trainer(strategy="smart_infinity")` works once Lightning is imported after it."""
    _python(
        "import sys\n"
        "import lightning_smartinf\n"
        "from lightning_smartinf.devices.remote import server\n"
        "from lightning_smartinf.plan import planner\n"
        "heavy = sorted(m for m in ('lightning', 'deepspeed') if m in sys.modules)\n"
        "assert not heavy, f'imported {heavy}'\n"
        "import lightning as L\n"
        "trainer = L.Trainer(strategy='smart_infinity', accelerator='cpu', devices=1, logger=False)\n"
        "assert type(trainer.strategy).__name__ == 'SmartInfinityStrategy', trainer.strategy\n",
        tmp_path,
    )


def test_the_aio_op_loads_prebuilt_without_building(tmp_path: Path) -> None:
    prebuilt = PREBUILT_OPS / "async_io" / "async_io.so"
    if not prebuilt.is_file():
        lacking(f"{prebuilt} is not there (scripts/setup.sh installs libaio and builds it)")
    built_at = prebuilt.stat().st_mtime_ns
    done = _python(
        "import os\n"
        "import deepspeed  # its import sets PYTORCH_NVML_BASED_CUDA_CHECK: DeepSpeed's doing, not the op's\n"
        "from lightning_smartinf.zero.aio import load_aio_op\n"
        "before = dict(os.environ)\n"
        "load_aio_op()\n"
        "assert dict(os.environ) == before, 'loading the op left the environment changed'\n" + PRINT_LOADED_EXTENSIONS,
        tmp_path,
    )
    loaded = _loaded_extensions(done)
    assert prebuilt in loaded, done.stdout + done.stderr
    _assert_prebuilt(loaded, tmp_path)
    assert prebuilt.stat().st_mtime_ns == built_at, f"{prebuilt} was built again"


FIT = """
import lightning as L
from helpers.models import LMModule, token_loader
from lightning_smartinf import SmartInfinityStrategy
import torch

strategy = SmartInfinityStrategy(storage_paths=[{storage!r}], io_engine={io_engine!r})
trainer = L.Trainer(
    accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(LMModule(lambda model: (torch.optim.AdamW(model.parameters(), lr=1e-3), None)), token_loader(2))
"""


@pytest.mark.slow
def test_a_first_fit_loads_every_op_prebuilt(tmp_path: Path) -> None:
    """DeepSpeed loads ops of its own during fit (on the CPU accelerator ``deepspeed.init_distributed`` loads the
    shared-memory comm op); those come from the pre-built ones too."""
    if not PREBUILT_OPS.is_dir():
        lacking(f"{PREBUILT_OPS} is not there (scripts/setup.sh builds DeepSpeed's ops there)")
    expected = [PREBUILT_OPS / "async_io" / "async_io.so"]
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        expected.append(PREBUILT_OPS / "deepspeed_shm_comm" / "deepspeed_shm_comm.so")
    expected = [op for op in expected if op.is_file()]
    io_engine = "aio" if expected and expected[0].name == "async_io.so" else "threads"
    (tmp_path / "storage").mkdir()
    fit = FIT.format(storage=str(tmp_path / "storage"), io_engine=io_engine)
    done = _python(fit + PRINT_LOADED_EXTENSIONS, tmp_path, timeout=600)
    loaded = _loaded_extensions(done)
    _assert_prebuilt(loaded, tmp_path)
    assert set(expected) <= set(loaded), f"expected {expected} loaded, found {loaded}"


def in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` with this Python in a new process; it must succeed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_moved_module_imports_by_its_old_name_with_a_warning() -> None:
    """Every old name of a moved module imports as the module at its new place, warning once, in a fresh
    interpreter (also ``python -m`` of the old name of the demo)."""
    import lightning_smartinf

    code = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import lightning_smartinf\n"
        f"for old, new in {dict(lightning_smartinf._MOVED)!r}.items():\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except DeprecationWarning as warning:\n"
        "        assert new in str(warning), warning\n"
        "    else:\n"
        "        raise AssertionError(f'{old}: no warning')\n"
        "    warnings.simplefilter('ignore', DeprecationWarning)\n"
        "    assert importlib.import_module(old) is importlib.import_module(new)\n"
        "    warnings.simplefilter('error', DeprecationWarning)\n"
    )
    in_a_fresh_interpreter(code)
    demo = subprocess.run(
        [sys.executable, "-m", "lightning_smartinf.demo", "--help"], capture_output=True, text=True, timeout=300
    )
    assert demo.returncode == 0 and "usage: smartinf demo" in demo.stdout, demo.stderr[-2000:]


#: Renamed public names: (module, old name, new name).
RENAMED = [
    ("lightning_smartinf", "SmartUpdate", "SmartUpdateController"),
    ("lightning_smartinf.core.controller", "SmartUpdate", "SmartUpdateController"),
    ("lightning_smartinf.core.placement", "Tiered", "TieredPlacement"),
    ("lightning_smartinf.activations", "ActivationOffloader", "SavedTensorOffloader"),
    ("lightning_smartinf.activations.offload", "ActivationOffloader", "SavedTensorOffloader"),
    ("lightning_smartinf.core.native", "int8_kernels", "state_format_kernels"),
]


def test_a_renamed_public_name_imports_by_its_old_name_with_a_warning() -> None:
    """``from module import Old`` gives the object named ``New`` now, with a warning naming both, in a fresh
    interpreter; a name that never was is still missing."""
    code = (
        "import importlib, warnings\n"
        f"for module, old, new in {RENAMED!r}:\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always', DeprecationWarning)\n"
        "        value = getattr(importlib.import_module(module), old)\n"
        "    assert value is getattr(importlib.import_module(module), new), (module, old)\n"
        "    assert [str(w.message) for w in caught if new in str(w.message) and old in str(w.message)], caught\n"
        "    assert not hasattr(importlib.import_module(module), 'NeverWas'), module  # `from ... import` fails\n"
    )
    in_a_fresh_interpreter(code)


@pytest.mark.slow
def test_python_m_of_a_moved_name_runs_with_the_modules_file_as_argv0() -> None:
    """``python -m lightning_smartinf.demo`` (the old name) runs with ``sys.argv[0]`` the moved module's file, as
    ``python -m`` of the new name does: runpy takes it from the spec's origin, and a ``None`` there failed the demo
    where the storage claim records the command line."""
    code = (  # what the demo's argument parser sees as `sys.argv[0]` under `python -m`
        "import argparse, runpy, sys\n"
        "parse = argparse.ArgumentParser.parse_args\n"
        "def seen(self, *args, **kwargs):\n"
        "    print('ARGV0', sys.argv[0])\n"
        "    return parse(self, *args, **kwargs)\n"
        "argparse.ArgumentParser.parse_args = seen\n"
        "sys.argv = ['-m', '--help']\n"
        "try:\n"
        "    runpy.run_module('lightning_smartinf.demo', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    argv0 = done.stdout.split("ARGV0 ", 1)[-1].splitlines()[0]
    assert argv0 == str(PACKAGE / "commands" / "demo.py"), done.stdout[-2000:]
