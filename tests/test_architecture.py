"""The design's arrows, checked on the installed package: a module imports only its own layer or lower ones.

Walks every module of the installed `kvjax` (including `kvjax.eval`, `kvjax.train` and
`kvjax.pallas_kernels`, which live in the repository's top-level folders), reads its imports from the source
(static `import` statements, function-local ones included) and fails on an arrow the layer order forbids.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import sys

import pytest

# Lowest first. A module may import modules of its own layer or of lower layers, except where noted.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("kvjax.pallas_kernels",)),  # know no model and no state class
    ("foundation", ("kvjax.util", "kvjax.tasks")),  # pure helpers and task generators
    ("models", ("kvjax.models",)),  # config, rope, checkpoints, the transformer with its `attend` seam
    ("cache", ("kvjax.cache",)),  # the paged state and attention over it; knows no method
    ("policies", ("kvjax.policies",)),  # Locret's heads included: the policy runs them
    ("engine", ("kvjax.engine",)),  # the one step and what drives it
    ("page pool", ("kvjax.jenga",)),  # Jenga's host-side allocator: the batch engine's pages come from it
    ("subsystems", ("kvjax.serving", "kvjax.rag", "kvjax.distributed", "kvjax.locret")),  # apart
    ("api", ("kvjax",)),  # the package's public names (kvjax/__init__.py)
    ("programs", ("kvjax.eval", "kvjax.train")),  # use the library's public modules
    ("command line", ("kvjax.cli",)),  # runs the programs by module name (importlib), never by import
]
SIBLINGS_APART = {"subsystems"}
PACKAGES = ("kvjax", "kvjax.eval", "kvjax.train", "kvjax.pallas_kernels")
PROJECT = re.compile(r"^(kvjax|eval|train|pallas_kernels)(\.|$)")


def _part(module: str) -> tuple[int, str]:
    """(layer index, the part of that layer the module belongs to) by longest matching prefix."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
    return best


def _installed_modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, by dotted name, with its source file."""
    found = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed as a package"
        for root in spec.submodule_search_locations:
            root = pathlib.Path(root)
            for path in root.rglob("*.py"):
                rel = path.relative_to(root).with_suffix("").parts
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                name = ".".join((package, *rel))
                if name.split(".")[1:2] in (["eval"], ["train"], ["pallas_kernels"]) and package == "kvjax":
                    continue  # not reachable under kvjax/ in the source tree; listed under its own package
                found[name] = path
    return found


def _imports(module: str, path: pathlib.Path, modules: set[str]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for each project import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # `from kvjax import pallas_kernels` imports a module
                    out.append((sub, "", node.lineno))
                else:
                    out.append((target, alias.name, node.lineno))
    return [entry for entry in out if PROJECT.match(entry[0])]


def test_every_module_belongs_to_a_layer_and_imports_only_downward():
    modules = _installed_modules()
    names = set(modules)
    problems = []
    for module, path in sorted(modules.items()):
        layer, part = _part(module)
        for target, name, line in _imports(module, path, names):
            where = f"{path}:{line}: {module} imports {target}{'.' + name if name else ''}"
            if not target.startswith("kvjax"):
                problems.append(f"{where} (a top-level name: import it as kvjax.{target})")
                continue
            target_layer, target_part = _part(target)
            if target_layer > layer:
                problems.append(f"{where} ({LAYERS[layer][0]} may not import {LAYERS[target_layer][0]})")
            elif (target_layer == layer and LAYERS[layer][0] in SIBLINGS_APART and target_part != part):
                problems.append(f"{where} ({part} and {target_part} are siblings and stay apart)")
            private = name.startswith("_") or any(seg.startswith("_") and seg != "__init__" for seg in target.split("."))
            if private and target_part != part:
                problems.append(f"{where} (a private name of another part)")
    assert not problems, "forbidden arrows:\n" + "\n".join(problems)


# The model's `attend` seam: a forward that calls the caller's attention back from inside its layers. The
# library's steps drive the layer loop themselves with the model's pieces (embed, layer_inputs,
# layer_output, final_logits), so only the dense no-cache forward passes an `attend`.
ATTEND_SEAM = {"CausalLM", "Segment", "unrolled", "apply_layers", "AttendFn"}
SEAM_USERS = {"kvjax.engine.api"}  # `dense_forward`, the reference every cached path is checked against


def test_only_the_dense_forward_passes_the_model_an_attend():
    modules = _installed_modules()
    library = max(index for index, (name, _) in enumerate(LAYERS) if name == "api")
    found = [
        f"{path}:{line}: {module} imports {name}"
        for module, path in sorted(modules.items())
        if _part(module)[0] <= library and _part(module)[1] != "kvjax.models" and module not in SEAM_USERS
        for target, name, line in _imports(module, path, set(modules))
        if target.startswith("kvjax.models") and name in ATTEND_SEAM
    ]
    assert not found, "the model calls back into these modules' attention:\n" + "\n".join(found)


def test_the_checker_sees_a_forbidden_arrow(tmp_path):
    """The walk above must fail on an upward import: a library module importing a program."""
    bad = tmp_path / "bad.py"
    bad.write_text("from kvjax.eval import sweep\nfrom kvjax.engine.generation import _private\n")
    found = _imports("kvjax.cache.state", bad, {"kvjax.eval.sweep"})
    assert ("kvjax.eval.sweep", "", 1) in found
    assert _part("kvjax.eval.sweep")[0] > _part("kvjax.cache.state")[0]
    assert ("kvjax.engine.generation", "_private", 2) in found


def test_no_generic_top_level_names_are_installed():
    """`eval`, `train` and `pallas_kernels` install under kvjax: from a neutral working directory none of
    them is importable as a top-level module."""
    here = os.getcwd()
    saved = list(sys.path)
    try:
        os.chdir(os.path.expanduser("~"))
        sys.path[:] = [p for p in sys.path if p not in ("", ".", here) and not pathlib.Path(p).resolve() == pathlib.Path(here).resolve()]
        for name in ("eval", "train", "pallas_kernels"):
            if name in sys.modules:
                continue  # imported from the checkout by another test (pytest's rootdir on sys.path)
            assert importlib.util.find_spec(name) is None, f"a top-level module {name!r} is installed"
    finally:
        sys.path[:] = saved
        os.chdir(here)


def test_pyproject_lists_every_package_folder():
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, mapped = set(config["packages"]), config.get("package-dir", {})
    folders = {}
    for package in PACKAGES:
        folder = root / mapped.get(package, package.replace(".", "/"))
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            name = ".".join((package, *rel))
            if name.split(".")[1:2] in (["eval"], ["train"], ["pallas_kernels"]) and package == "kvjax":
                continue
            folders[name] = init.parent
    missing = sorted(set(folders) - listed)
    assert not missing, f"package folders not installed (add them to pyproject.toml): {missing}"


@pytest.mark.parametrize("program", ["kvjax.eval.bench_decode", "kvjax.eval.sweep", "kvjax.train.locret"])
def test_programs_import_under_the_kvjax_namespace(program):
    module = importlib.import_module(program)
    assert callable(module.main)


def test_each_layer_is_a_folder():
    """The package's root holds only its public names and the command line; every other module lives in the
    folder of its layer, so a reader finds a layer by its folder."""
    root = pathlib.Path(importlib.util.find_spec("kvjax").origin).parent
    loose = sorted(p.name for p in root.glob("*.py"))
    assert loose == ["__init__.py", "cli.py"], f"modules outside a layer's folder: {loose}"
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            if prefix in ("kvjax", "kvjax.cli"):
                continue
            assert importlib.util.find_spec(prefix).submodule_search_locations, f"{prefix} is not a folder"


def _library_modules() -> list[pathlib.Path]:
    repo = pathlib.Path(__file__).resolve().parent.parent
    return sorted((repo / "kvjax").rglob("*.py")) + sorted((repo / "pallas_kernels").glob("*.py"))


def test_module_docstrings_are_short_and_their_notes_exist():
    """A library module's docstring says what it is in at most four lines; longer notes live in
    docs/modules.md, in the section its `Notes:` line names."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    sections = set(re.findall(r"(?m)^## `([^`]+)`$", (repo / "docs" / "modules.md").read_text()))
    long, missing = [], []
    for path in _library_modules():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        name = path.relative_to(repo).as_posix()
        if doc.strip().count("\n") + 1 > 4:
            long.append(name)
        for target in re.findall(r"Notes: docs/modules\.md \(`([^`]+)`\)", doc):
            if target not in sections:
                missing.append(f"{name} -> {target}")
    assert not long, f"module docstrings longer than four lines: {long}"
    assert not missing, f"Notes lines naming no section of docs/modules.md: {missing}"


def _import_cycles(package: str) -> list[list[str]]:
    """The import circles among a package's modules (strongly connected groups of two or more), counting
    imports inside functions too (a function-local import hides a circle, it does not remove it)."""
    modules = {name: path for name, path in _installed_modules().items() if name.startswith(package + ".")}
    graph = {name: {target for target, _, _ in _imports(name, path, set(modules)) if target in modules and target != name}
             for name, path in modules.items()}
    order, low, stack, cycles, counter = {}, {}, [], [], [0]

    def visit(node):
        order[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def test_the_programs_import_in_no_circle():
    """eval/'s programs and shared pieces (`eval/lib`) import one another without a circle, function-local
    imports included."""
    assert _import_cycles("kvjax.eval") == []


EVAL_LIB = "kvjax.eval.lib"


def _eval_arrows(modules: dict[str, pathlib.Path]) -> list[str]:
    """The imports that break eval/'s shape: a program (a module of `kvjax.eval` outside `eval/lib`) importing
    another program, or `eval/lib` importing a program (function-local imports included)."""
    names = set(modules)
    problems = []
    for module, path in sorted(modules.items()):
        if not module.startswith("kvjax.eval."):
            continue
        for target, name, line in _imports(module, path, names):
            if target == "kvjax.eval" and f"kvjax.eval.{name}" not in names:
                continue  # a name of the package itself
            if not target.startswith("kvjax.eval.") or target == module:
                continue
            if not (target == EVAL_LIB or target.startswith(EVAL_LIB + ".")):
                kind = "eval/lib's" if module.startswith(EVAL_LIB + ".") else "the program"
                problems.append(f"{path}:{line}: {kind} {module} imports the program {target}"
                                f"{'.' + name if name else ''} (move what both use to eval/lib)")
    return problems


def test_eval_programs_are_leaves():
    """Every eval/ program imports only the library and eval/lib; eval/lib imports no program. What two
    programs share lives in eval/lib (report, timing, tables, policy specs, the tasks), so a program can be
    read, moved or deleted alone."""
    modules = _installed_modules()
    assert any(m.startswith(EVAL_LIB + ".") for m in modules), "eval/lib is not installed"
    problems = _eval_arrows(modules)
    assert not problems, "eval/ programs must be leaves:\n" + "\n".join(problems)


def test_the_leaf_check_sees_a_program_importing_a_program(tmp_path):
    """The check above fails on a program importing another (inside a function too) and on eval/lib importing
    a program; a program importing eval/lib passes."""
    files = {}
    for name, text in {"kvjax.eval.demo": "from .lib.report import markdown_table\n\ndef f():\n    from . import sweep\n",
                       "kvjax.eval.lib.tables": "from ..sweep import accuracy_table\n",
                       "kvjax.eval.lib.report": "import os\n", "kvjax.eval.sweep": "from .lib import report\n"}.items():
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(text)
    found = [p.split(": ", 1)[1].split(" (")[0] for p in _eval_arrows(files)]
    assert found == ["the program kvjax.eval.demo imports the program kvjax.eval.sweep",
                     "eval/lib's kvjax.eval.lib.tables imports the program kvjax.eval.sweep.accuracy_table"]


# One Quest decode step through the public `kvjax.decode_step`, as traced: the files of kvjax/ whose Python
# runs (the kernels' package aside), and the only modules that enter `kvjax.pallas_kernels`. The step routes
# nothing through the prefill step (`engine/step.py`) or the host loops (`engine/generation.py`).
DECODE_WALK = {"engine/api.py", "engine/decode.py", "models/transformer.py", "models/rope.py", "models/config.py",
               "cache/state.py", "cache/attention.py", "policies/base.py", "policies/quest.py"}
# (kvjax file, kernels' file it calls): each kernel from the one module that owns the choice, and the
# state's page format (int8 / bfloat16 storage) from the state
LISTENERS = {"util/compile_count.py"}  # JAX's compile events call it when another test has registered it
KERNEL_CALLS = {("cache/attention.py", "paged_decode.py"), ("policies/quest.py", "quest_scores.py"),
                ("cache/state.py", "_quant.py")}


def _walk_one_decode_step() -> tuple[set, set]:
    """(kvjax files entered, (kvjax file, kernels' file) calls into the kernels' package) while one Quest
    decode step is traced; a config no other test uses, so nothing comes from a compile cache."""
    import sys

    import numpy as np

    import kvjax
    from kvjax.models.config import ModelConfig
    from kvjax.models.loading import Model, init_params

    cfg = ModelConfig(model_type="llama", max_position_embeddings=512, vocab_size=97, hidden_size=40,
                      intermediate_size=56, num_layers=3, num_heads=5, num_kv_heads=1, head_dim=8)
    model = Model(cfg, init_params(cfg, seed=0))
    policy = kvjax.make_policy("quest", token_budget=16, page_size=8, dense_layers=1)
    state, _ = kvjax.prefill(model, [list(range(1, 40))], policy, page_size=8, max_new_tokens=4)
    root = str(pathlib.Path(kvjax.__file__).parent) + "/"
    kernels = str(pathlib.Path(importlib.util.find_spec("kvjax.pallas_kernels").origin).parent) + "/"
    entered, callers = set(), set()

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name.startswith(root) and name[len(root):] not in LISTENERS:
            entered.add(name[len(root):])
        elif name.startswith(kernels) and frame.f_back is not None and frame.f_back.f_code.co_filename.startswith(root):
            callers.add((frame.f_back.f_code.co_filename[len(root):], name[len(kernels):]))

    sys.setprofile(profile)
    try:
        kvjax.decode_step(model, state, [5], policy)
    finally:
        sys.setprofile(None)
    return entered, callers


def test_a_quest_decode_step_walks_these_files():
    """The walk docs/design.md lists ("One Quest decode step, walked"): a file added to it, or the step
    routed back through the prefill step or the host loops, fails here."""
    entered, callers = _walk_one_decode_step()
    assert entered == DECODE_WALK, f"entered {sorted(entered - DECODE_WALK)}, not {sorted(DECODE_WALK - entered)}"
    assert callers == KERNEL_CALLS, f"the kernels' package is entered as {sorted(callers)}"
