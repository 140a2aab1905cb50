"""core/ must stay pure Python: importing it pulls in neither torch nor transformers."""

import ast
import subprocess
import sys
from pathlib import Path


def assert_import_stays_light(*modules: str) -> None:
    """Importing ``modules`` in a fresh interpreter loads neither torch, transformers nor numpy."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_core_imports_no_torch() -> None:
    assert_import_stays_light(
        "swiftserve.core.scheduler",
        "swiftserve.core.block_manager",
        "swiftserve.core.request_queue",
        "swiftserve.sampling_params",
        "swiftserve.config",
    )


def test_serving_frontend_imports_neither_torch_nor_transformers() -> None:
    """The server process never loads torch (the engine process does) nor transformers."""
    assert_import_stays_light(
        "swiftserve.cli",
        "swiftserve.server.launcher",
        "swiftserve.server.app",
        "swiftserve.engine.async_llm",
        "swiftserve.server.draining",
    )


# ---- the layering of DESIGN.md, checked on the import statements themselves ----------------------
SRC = Path(__file__).resolve().parent.parent / "src" / "swiftserve"
RUNTIME = ("core", "engine", "server", "worker", "model", "batching")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions), absolute names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((SRC / package).rglob("*.py")):
            for name in imported_modules(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(SRC)} imports {name}")
    return found


def test_core_imports_nothing_heavy() -> None:
    assert (
        offenders(("core",), ("torch", "transformers", "numpy", "swiftserve.model", "swiftserve.worker"))
        == []
    )


def test_engine_and_server_reach_the_model_only_through_the_worker() -> None:
    assert offenders(("engine", "server"), ("swiftserve.model",)) == []


def test_runtime_never_imports_the_tools() -> None:
    assert offenders(RUNTIME, ("swiftserve.tools",)) == []
