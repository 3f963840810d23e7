"""Refusing a submission that uses the reference implementation of what it was asked to write.

Each graded test file declares, at module level and as literal lists, what its exercise must not
use::

    REFERENCE_MODULES = ["zerolab.ring"]           # modules (or module attributes) that implement it
    REFERENCE_ALLOWED = ["zerolab.ring.exchange"]  # what the exercise explicitly offers from them

``solutions`` (the course's worked answers) is refused for every exercise. When an exercise is
redesigned, its lists change with it; the grader reads them from the test file.

Checked twice, because a static check alone is easy to dodge:

* :func:`static_check`, before any test runs, on the submitted file's text (``ast``): imports,
  dotted names reached through an imported module, ``importlib.import_module("...")`` and
  ``__import__("...")`` with a literal name;
* at run time, in every process that imports the submission (:func:`guard` before the import,
  :func:`runtime_check` after it): objects in the module's namespace that come from a refused
  module (functions, classes, their base classes, methods copied into its classes, modules), and
  calls made from the submitted file into a refused function however it was reached (a name
  built at run time, ``getattr``, ``sys.modules``) raise :class:`ReferenceImplementationError`.

A refusal message starts with :data:`REFUSED`; the grader scores the whole exercise 0 with it.
"""
import ast
import functools
import importlib
import inspect
import sys
import types

REFUSED = "refused: "
ALWAYS_REFUSED = ("solutions", "zerolab.grade")  # the worked answers, and the grader's own code

# What no exercise needs, and what would let a submission dodge the checks above or reach the
# grader's records in its own process: code built at run time (a file name of its choosing, a
# module name assembled from pieces), introspection of frames, modules and functions, and the
# process group's raw methods beneath torch.distributed's functions (which the graded tests observe).
DYNAMIC_NAMES = {"exec", "eval", "compile", "__import__", "__builtins__", "globals", "locals", "vars",
                 "breakpoint"}
DYNAMIC_MODULES = {"importlib", "builtins", "gc", "inspect", "ctypes", "marshal", "code", "codeop",
                   "runpy", "pkgutil", "zipimport", "_thread"}
DYNAMIC_ATTRIBUTES = {
    "__code__", "__globals__", "__builtins__", "__subclasses__", "__closure__", "__dict__",
    "__loader__", "__spec__", "__self__", "f_back", "f_globals", "f_locals", "f_code", "gi_frame",
    "tb_frame", "cr_frame", "ag_frame", "_getframe", "settrace", "setprofile", "CodeType",
    "FunctionType", "fdopen", "fromfd", "dup2",
    "allreduce", "allgather", "alltoall", "allreduce_coalesced", "allgather_coalesced",
    "_allgather_base", "_reduce_scatter_base", "_get_default_group", "distributed_c10d", "_world"}
SYS_ATTRIBUTES = {"modules", "meta_path", "path_hooks", "path_importer_cache", "_getframe", "settrace",
                  "setprofile", "addaudithook"}  # sys.<these>
_ATTRIBUTE_BUILTINS = ("getattr", "setattr", "delattr")


class ReferenceImplementationError(RuntimeError):
    """The submission used the reference implementation of its own exercise."""


def declaration(test_file):
    """(REFERENCE_MODULES, REFERENCE_ALLOWED) declared by a graded test file, read without importing
    it (the grader's parent process stays free of torch). Missing lists are empty."""
    tree = ast.parse(open(test_file, encoding="utf-8").read(), filename=str(test_file))
    found = {"REFERENCE_MODULES": [], "REFERENCE_ALLOWED": []}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and node.targets[0].id in found:
            value = ast.literal_eval(node.value)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{test_file}: {node.targets[0].id} must be a literal list of dotted "
                                 f"names, got {value!r}")
            found[node.targets[0].id] = list(value)
    return found["REFERENCE_MODULES"], found["REFERENCE_ALLOWED"]


def _under(name, root):
    return name == root or name.startswith(root + ".")


def refused_entry(name, refused, allowed):
    """The entry of ``refused`` (or ``solutions``) that covers the dotted ``name``; None when none
    does or when ``name`` is allowed (an allowed name and everything under it)."""
    if any(_under(name, a) for a in allowed):
        return None
    return next((r for r in (*ALWAYS_REFUSED, *refused) if _under(name, r)), None)


def _holds_allowed(name, allowed):
    """Whether ``name`` is a module some allowed name lives in (``zerolab.ring`` for
    ``zerolab.ring.exchange``): importing it is fine, using a refused part of it is not."""
    return any(a.startswith(name + ".") for a in allowed)


def _message(filename, where, name, entry):
    what = ("the course's worked answers" if entry in ALWAYS_REFUSED
            else "the reference implementation of this exercise")
    return (f"{REFUSED}{filename}{where} uses {name}, from {entry}: {what}. An exercise must be "
            f"your own code (use only what the exercise offers)")


def static_check(source, filename, refused, allowed):
    """The refusal message for the first use of a refused name in ``source``, else None.
    A SyntaxError propagates (the grader reports it as such)."""
    tree = ast.parse(source, filename=filename)
    aliases = {}  # local name -> the dotted module name it is bound to (checked where it is used)

    def bad(name, node):
        entry = None if _holds_allowed(name, allowed) else refused_entry(name, refused, allowed)
        return entry and _message(filename, f" line {node.lineno}", name, entry)

    for node in ast.walk(tree):
        reason = None
        if isinstance(node, ast.Import):
            for a in node.names:
                reason = reason or bad(a.name, node)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if a.name == "*":  # all of a refused module; other modules: the run-time check
                    entry = refused_entry(node.module, refused, allowed)
                    reason = reason or (entry and _message(filename, f" line {node.lineno}",
                                                           f"{node.module}.*", entry))
                else:
                    reason = reason or bad(f"{node.module}.{a.name}", node)
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")):
            reason = bad(node.args[0].value, node)
        if reason:
            return reason
    reason = _dynamic(tree, filename)
    if reason:
        return reason
    # Where an imported module is used: zerolab.ring.exchange is fine, zerolab.ring.ring_all_reduce
    # (or the module zerolab.ring itself, passed around) is not.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if id(node) in inner or not isinstance(node, (ast.Name, ast.Attribute)):
            continue
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            name = ".".join([aliases[base.id], *reversed(chain)])
            entry = refused_entry(name, refused, allowed)
            if entry:
                return _message(filename, f" line {node.lineno}", name, entry)
    return None


def _dynamic(tree, filename):
    """The refusal message for the first dynamic construct (DYNAMIC_*) in ``tree``, else None."""
    def refuse(node, what):
        return (f"{REFUSED}{filename} line {node.lineno} uses {what}: a submission may not build code "
                f"or names at run time, inspect frames, modules or functions, or call a process "
                f"group's raw methods. Write the exercise with plain Python, torch and "
                f"torch.distributed's functions")

    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in DYNAMIC_NAMES:
            return refuse(node, node.id)
        if isinstance(node, ast.Attribute) and node.attr in DYNAMIC_ATTRIBUTES:
            return refuse(node, f".{node.attr}")
        if (isinstance(node, ast.Attribute) and node.attr in SYS_ATTRIBUTES
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            return refuse(node, f"sys.{node.attr}")
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in DYNAMIC_MODULES:
                    return refuse(node, f"import {a.name}")
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0]
                                                 in DYNAMIC_MODULES):
            return refuse(node, f"from {'.' * node.level}{node.module or ''} import")
        if (isinstance(node, ast.ImportFrom) and node.module == "sys"
                and any(a.name in SYS_ATTRIBUTES | {"*"} for a in node.names)):
            return refuse(node, "from sys import " + ", ".join(a.name for a in node.names))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _ATTRIBUTE_BUILTINS):
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and not name.value.startswith("_")):
                return refuse(node, f"{node.func.id} with a name that is not a public literal")
    return None


def _dotted(obj):
    """The dotted name an object was defined under (module.qualname), or None."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # bound methods, staticmethod, classmethod
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            return f"{module}.{qualname}"
    return None


def runtime_check(module, refused, allowed):
    """Raise :class:`ReferenceImplementationError` if the imported submission ``module`` holds an
    object from a refused module: bound at module level, as a base class of one of its classes,
    or copied into one of its classes."""
    filename = module.__name__.rpartition(".")[2] + ".py"
    for attr, value in list(vars(module).items()):
        if attr == "__builtins__":
            continue
        found = [value]
        if inspect.isclass(value) and value.__module__ == module.__name__:
            found += list(value.__mro__[1:]) + list(vars(value).values())
        for obj in found:
            name = _dotted(obj)
            if name is None or (isinstance(obj, types.ModuleType) and _holds_allowed(name, allowed)):
                continue
            entry = refused_entry(name, refused, allowed)
            if entry:
                raise ReferenceImplementationError(_message(filename, f" (its {attr})", name, entry))


def _guarded(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        reason = call.refused_from.get(sys._getframe(1).f_code.co_filename)
        if reason:
            raise ReferenceImplementationError(reason)
        return fn(*args, **kwargs)
    del call.__wrapped__          # no way back to the unguarded function through the wrapper
    call.refused_from = {}        # submitted file -> refusal message
    return call


def _targets(entry):
    """(owner, attribute name, dotted name) of every function a refused entry names: all the
    functions a refused module defines, or the one function a refused attribute is."""
    parts = entry.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))  # the name is data: a declaration
        except Exception:  # not a module (an attribute), or a module that cannot be imported here
            continue
        if cut == len(parts):  # a module: every function it defines
            return [(owner, n, f"{entry}.{n}") for n, f in vars(owner).items()
                    if inspect.isfunction(f) and f.__module__ == entry]
        for attr in parts[cut:-1]:  # an attribute: a function, or a method of a class
            owner = getattr(owner, attr, None)
        fn = getattr(owner, parts[-1], None)
        return [(owner, parts[-1], entry)] if inspect.isfunction(fn) else []
    return []


def guard(filename, refused, allowed):
    """From now on in this process, a call made from the code of ``filename`` (a submitted file)
    straight into a function of a refused entry raises :class:`ReferenceImplementationError`.
    Other callers (the engines, the graded tests' references) are unaffected."""
    shown = filename.rpartition("/")[2]
    for entry in refused:
        for owner, attr, name in _targets(entry):
            if refused_entry(name, refused, allowed) is None:
                continue
            fn = getattr(owner, attr)
            if not hasattr(fn, "refused_from"):
                fn = _guarded(fn)
                setattr(owner, attr, fn)
            fn.refused_from[filename] = _message(shown, " (at run time)", name, entry)
