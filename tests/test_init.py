"""The package itself: ``import optimshift`` stays light yet its subpackages are attributes (loaded on first
access, typed for mypy), and the modules under src/optimshift import each other without a cycle."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# What `import optimshift` must not import: DCP (seconds to import) and every framework an integration wraps.
HEAVY = (
    "torch.distributed.checkpoint",
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "verl",
    "deepspeed",
)


def _run(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=SRC.parent
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_subpackages_are_attributes_loaded_on_first_access():
    out = _run(
        f"""
        import json, sys
        import optimshift

        heavy = {HEAVY!r}

        def loaded(*names):
            return sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))

        after_import = loaded(*heavy, "optimshift.distributed", "optimshift.testing", "optimshift.integrations")
        listed = [n for n in ("distributed", "integrations", "testing") if n in dir(optimshift)]
        save = optimshift.distributed.save
        sim = optimshift.testing.simulated_accelerator
        after_testing = loaded("lightning", "accelerate", "transformers")
        integrations = optimshift.integrations
        after_integrations = loaded(*heavy[1:])
        in_dir = [n for n in ("lightning", "accelerate", "third_party") if n in dir(integrations)]
        register = integrations.third_party.register
        lightning = integrations.lightning
        try:
            optimshift.no_such_thing
            missing = None
        except AttributeError as e:
            missing = str(e)
        try:
            integrations.no_such_integration
            missing_integration = None
        except AttributeError as e:
            missing_integration = str(e)
        print(json.dumps({{
            "after_import": after_import,
            "listed": listed,
            "save": f"{{save.__module__}}.{{save.__name__}}",
            "sim": sim.__name__,
            "after_testing": after_testing,
            "after_integrations": after_integrations,
            "in_dir": in_dir,
            "register": register.__module__,
            "lightning": lightning.__name__,
            "patch": callable(lightning.patch),
            "same": lightning is sys.modules["optimshift.integrations.lightning"],
            "missing": missing,
            "missing_integration": missing_integration,
        }}))
        """
    )
    assert out["after_import"] == [], "import optimshift must import no subpackage, DCP or framework"
    assert out["listed"] == ["distributed", "integrations", "testing"]
    assert out["save"] == "optimshift.distributed._checkpoint.save" and out["sim"] == "simulated_accelerator"
    assert out["after_testing"] == [] and out["after_integrations"] == []
    assert out["in_dir"] == ["lightning", "accelerate", "third_party"]
    assert out["register"] == "optimshift.integrations.third_party"
    assert out["lightning"] == "optimshift.integrations.lightning" and out["patch"] and out["same"]
    assert out["missing"] == "module 'optimshift' has no attribute 'no_such_thing'"
    assert out["missing_integration"] == "module 'optimshift.integrations' has no attribute 'no_such_integration'"


def test_mypy_types_the_lazy_attributes(tmp_path):
    api = pytest.importorskip("mypy.api")
    use = tmp_path / "use.py"
    use.write_text(
        "import optimshift\n\n"
        "reveal_type(optimshift.distributed.save)\n"
        "reveal_type(optimshift.testing.simulated_accelerator)\n"
        "reveal_type(optimshift.integrations.lightning.patch)\n"
        "reveal_type(optimshift.integrations.accelerate.patch)\n"
        "reveal_type(optimshift.integrations.third_party.register)\n"
    )
    # the cache scripts/lint fills: a cold one would re-read torch's stubs (a minute)
    cache = SRC.parent / ".mypy_cache"
    stdout, stderr, status = api.run(["--strict", "--cache-dir", str(cache), "--no-error-summary", str(use)])
    revealed = [line.split("Revealed type is ", 1)[1] for line in stdout.splitlines() if "Revealed type is" in line]
    assert status == 0, stdout + stderr
    assert len(revealed) == 5 and not any(r.strip('"') == "Any" for r in revealed), stdout
    assert revealed[0].startswith('"def (path: ') and "-> torch._C.device" in revealed[1], stdout


# --- no import cycle --------------------------------------------------------------------------------------------


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module under src/optimshift: dotted name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in sorted((SRC / "optimshift").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Which optimshift modules each one imports anywhere in its source (module level, functions and
    TYPE_CHECKING blocks alike): ``from X import name`` counts as importing ``X.name`` when that is a module,
    else ``X``. A module's own packages are not counted (Python imports them first, never the other way)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in modules else target)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, else None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "optimshift.checkpoint._records" in graph["optimshift.checkpoint._files"]  # from . import _records
    assert "optimshift._state" in graph["optimshift.checkpoint._files"]  # from .._state import unwrap
    assert "optimshift._device_streams" in graph["optimshift.testing._sim_streams"]  # inside install()
    assert "optimshift.distributed._checkpoint" in graph["optimshift.distributed"]  # a TYPE_CHECKING block


def test_no_import_cycle_among_optimshift_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _architecture_rows() -> list[list[str]]:
    """The module names in the first cell of each row of ARCHITECTURE.md's table, in order (``x.py``, ``pkg/``)."""
    text = (SRC.parent / "ARCHITECTURE.md").read_text()
    return [re.findall(r"`([^`]+)`", m.group(1)) for m in re.finditer(r"^\| (`[^|]*`) \|", text, re.MULTILINE)]


def _row_of(module: str, rows: list[list[str]]) -> int | None:
    parts = module.split(".")[1:]
    for i, names in enumerate(rows):
        for name in names:
            if (name.endswith("/") and parts[:1] == [name[:-1]]) or (len(parts) == 1 and name == parts[0] + ".py"):
                return i
    return None


def test_every_module_imports_only_modules_above_it_in_the_architecture_table():
    """ARCHITECTURE.md: data flows down its table, and a module imports only modules above it (or in its row).
    The package itself and its entry-point shims re-export everything and have no row."""
    rows = _architecture_rows()
    shims = {"optimshift", "optimshift.__main__", "optimshift.bench"}
    graph = import_graph()
    unlisted = sorted(m for m in graph if m not in shims and _row_of(m, rows) is None)
    assert unlisted == [], f"modules with no row in ARCHITECTURE.md: {unlisted}"
    upward = [
        f"{a} -> {b}"
        for a, targets in sorted(graph.items())
        if a not in shims
        for b in sorted(targets)
        if b not in shims and _row_of(b, rows) > _row_of(a, rows)  # type: ignore[operator]
    ]
    assert upward == [], "imports against the table's order: " + ", ".join(upward)
