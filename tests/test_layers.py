"""zerolab's import graph flows one way, as README's module table says: every import of a zerolab
module (at module level or inside a function) goes to the same layer or to one below, every module
has its layer, and no imports go round in a cycle. Read from the source (ast), nothing imported."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "zerolab"

# Bottom to top, as in README.md's table of modules.
LAYERS = [
    ("ranks", {"launch", "_protocol", "_worker", "_plain"}),
    ("collectives", {"comm", "ring", "mesh", "quantize"}),
    ("data structures", {"flat", "shard_optim", "memory", "activations", "data_parallel", "mixed_precision",
                         "meta_init", "units", "models", "aio", "chunked", "swap", "tiling", "prefetch"}),
    ("model parallelism", {"tensor_parallel", "pipeline"}),
    ("machinery", {"engine", "checkpoint"}),
    ("stages", {"zero0", "zero1", "zero2", "zero3", "hybrid", "fully_sharded"}),
    ("offload", {"offload", "cpu_adam", "infinity"}),
    ("entry point", {"stages"}),
    ("tools", {"cost", "calibrate", "demo", "calculator", "plots", "timeline", "train", "convergence",
               "cost_parallel", "tiers", "bandwidth_centric"}),
    ("grading", {"grade"}),
]
LEVEL = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
# `from zerolab import NAME` of a name the package re-exports (zerolab/__init__.py) or defines
REEXPORTED = {"initialize": "stages", "DataParallel": "data_parallel", "Zero1Optimizer": "zero1",
              "fully_shard": "fully_sharded", "clip_grad_norm_": "fully_sharded", "LossScaler": "mixed_precision",
              "Cluster": "launch", "RankError": "launch", "RankTimeout": "launch", "init_from_env": "launch",
              "launch": "launch", "rank_device": "launch", "rank_state": "launch", "__version__": "launch"}
FACADES = {"__init__", "__main__"}     # the package's lazy names and `python -m zerolab`: above everything


def module_of(path):
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else path.stem


def imports(path):
    """(line, zerolab module) for every import of a zerolab module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "zerolab":
                found += [(node.lineno, REEXPORTED.get(a.name, a.name)) for a in node.names]
            elif node.module.startswith("zerolab."):
                found.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("zerolab.")]
    return found


def graph():
    edges = {}
    for path in sorted(PKG.rglob("*.py")):
        m = module_of(path)
        if m in FACADES:
            continue
        for line, dep in imports(path):
            if dep != m:
                edges.setdefault(m, {}).setdefault(dep, f"{path.relative_to(PKG.parent)}:{line}")
    return edges


def test_every_module_has_a_layer():
    modules = {module_of(p) for p in PKG.rglob("*.py")} - FACADES
    assert modules - set(LEVEL) == set(), "modules missing from LAYERS (and README's table)"
    assert set(LEVEL) - modules == set(), "LAYERS names modules that do not exist"


def test_imports_go_down_or_across_never_up():
    edges = graph()
    up = [f"{where}: {m} ({LAYERS[LEVEL[m]][0]}) imports {dep} ({LAYERS[LEVEL[dep]][0]})"
          for m, deps in edges.items() for dep, where in deps.items()
          if dep in LEVEL and m in LEVEL and LEVEL[dep] > LEVEL[m]]
    unknown = [f"{where}: {m} imports {dep}, not a zerolab module" for m, deps in edges.items()
               for dep, where in deps.items() if dep not in LEVEL]
    assert up + unknown == []


def test_no_import_cycle():
    edges = graph()
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for dep in sorted(edges.get(m, {})):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("source, expected", [
    ("from zerolab import initialize\n", [(1, "stages")]),
    ("def f():\n    from zerolab.stages import initialize\n", [(2, "stages")]),
    ("import zerolab.comm as c\nfrom . import x\n", [(1, "comm")]),
])
def test_imports_are_read_inside_functions_too(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports(path) == expected
