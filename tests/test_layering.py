"""The layering of docs/architecture.md, read from the imports themselves (an AST walk of src/).

Every import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "refitflow"

# folder -> the folders its files may import (besides their own); keep in step with docs/architecture.md
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "metrics": set(),
    "layouts": {"core"},
    "transports": {"core"},
    "planner": {"core", "layouts"},
    "refit": {"core", "layouts", "transports", "metrics", "planner"},
    "registry": {"core"},
    "api": {"core", "layouts", "transports", "metrics", "planner", "refit", "registry"},
    "push": {"core", "layouts", "transports", "metrics", "planner", "refit", "api"},
    "engine": {"core", "layouts", "transports", "metrics", "planner", "refit", "registry", "api"},
}
ALLOWED["integrations"] = set(ALLOWED["engine"]) | {"engine", "push"}
ALLOWED["cli"] = set(ALLOWED) - {"cli"}
# single modules a folder may import beyond its floors: the registry's interface (it imports only core and the
# registry's plain records), which the stages and fan-out are handed a registry as
INTERFACES: dict[str, set[str]] = {"refit": {"refitflow.registry.protocol"}}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The refitflow modules a file imports (``from a import b`` may name a module ``a.b``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("refitflow")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("refitflow"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in SRC.rglob("*.py")}
    return {mod: {m for m in _imports(p) if m in files and m != mod} for mod, p in files.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (SRC / parts[1]).is_dir()) else None


def test_every_folder_is_known_and_has_a_docstring() -> None:
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED), "a new folder needs its place in ALLOWED and in docs/architecture.md"
    for name in folders:
        doc = ast.get_docstring(ast.parse((SRC / name / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"refitflow/{name}/__init__.py needs a one-paragraph docstring"


def test_folders_import_only_what_the_layering_allows() -> None:
    wrong = []
    for mod, deps in _graph().items():
        src = _folder(mod)
        if src is None:
            continue  # the package root (public API, __main__) may import anything
        for dep in deps:
            dst = _folder(dep)
            if dst is not None and dst != src and dst not in ALLOWED[src] and dep not in INTERFACES.get(src, ()):
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


# integrations/: the engine-neutral hosting layer imports no plug-in; plug-ins import hosting (and what is named)
PLUGINS: dict[str, set[str]] = {
    "hosting": set(),
    "lora": set(),
    "sglang": {"hosting"},
    "verl": {"hosting"},
    "trl": {"hosting", "vllm"},  # TRL's loop drives a vLLM server: the vLLM trainer side, the driver's versions
    "vllm": {"hosting", "lora"},
}
# vllm/ by process role: the worker backend, the server plug-ins, the trainer side, the RL loop's driver
VLLM_ROLES: dict[str, set[str]] = {"worker": set(), "server": set(), "trainer": set(), "driver": {"worker"}}


def _dir(prefix: str) -> pathlib.Path:
    return SRC / pathlib.Path(*prefix.split(".")[1:-1])


def _part(module: str, prefix: str) -> str | None:
    """The sub-package of ``prefix`` that ``module`` lies in (None: outside, or a module of ``prefix`` itself)."""
    rest = module[len(prefix) :].split(".") if module.startswith(prefix) else []
    return rest[0] if len(rest) > 1 or (rest and (_dir(prefix) / rest[0]).is_dir()) else None


def test_integrations_stand_on_hosting_and_vllm_is_cut_by_role() -> None:
    wrong = []
    for prefix, allowed in (("refitflow.integrations.", PLUGINS), ("refitflow.integrations.vllm.", VLLM_ROLES)):
        folders = {p.name for p in _dir(prefix).iterdir() if (p / "__init__.py").exists()}
        assert folders == set(allowed), f"a new folder under {prefix} needs its place here and in docs/architecture.md"
        for mod, deps in _graph().items():
            src = _part(mod, prefix)
            if src is None:
                continue
            for dep in deps:
                dst = _part(dep, prefix)
                if dst is not None and dst != src and dst not in allowed[src]:
                    wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the integrations' layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circles_between_files() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_only_the_cli_and_the_integrations_key_finder_read_the_environment() -> None:
    readers = []
    for path in SRC.rglob("*.py"):
        if _folder(_module(path)) == "cli" or _module(path) == "refitflow.integrations.hosting.keys":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(_module(path))
    assert not readers, (
        "only refitflow.cli and refitflow.integrations.hosting.keys may read environment variables: "
        f"{sorted(set(readers))}"
    )
