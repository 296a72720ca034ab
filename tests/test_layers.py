"""The shape of the Python layer, checked from its source (no process group is made).

* The import graph of pyddp's modules, subpackages included (a package counts as its
  ``__init__``), has no cycle. Every import counts, also the ones deferred into a
  function body: a module that imports another only lazily still depends on it.
  ``from . import x`` and ``from pyddp import x`` are edges to module x when x is a
  module, else (a name) to the package that defines it, as ``import pyddp`` is an edge
  to the top-level ``__init__``. The one upward edge allowed by design is none: what a
  lower module needs from a higher one is handed to it
  (``ddp._common.DistributedDataParallel._front``,
  ``_forensics.install_signal_dump(dump)``).
* No module is over 550 lines, and each starts with a docstring saying what it is for.
* No PYDDP_* variable is read from the environment except through the settings table
  (``_C.setting``/``_C.setting_text``): no ``os.environ``/``os.getenv`` lookup of a
  PYDDP_* name, spelled out or through a module-level constant.
* The forensics store records have one declaration, ``csrc/core/ddp_forensics.h``: its
  formats (what the C worker writes) name the fields of its field lists (what
  _forensics.py parses by), in order; a record written by those formats reads back
  field for field; no other C or Python source spells the keys or records out.
"""
import ast
import os
import re

import pytest

from launch import ROOT

PKG = os.path.join(ROOT, "pyddp")


def _modules():
    """Every Python module of the package, subpackages included, by its dotted name
    under pyddp ("_world", "ddp._torch", "elastic"): a package is its __init__."""
    out = []
    for d, _dirs, files in os.walk(PKG):
        rel = os.path.relpath(d, PKG)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and not os.path.exists(os.path.join(d, "__init__.py")):
            continue
        for f in files:
            if f.endswith(".py"):
                name = parts + ([] if f == "__init__.py" else [f[:-3]])
                out.append(".".join(name) or "__init__")
    return sorted(out)


MODULES = _modules()
PACKAGES = {m for m in MODULES if os.path.isdir(os.path.join(PKG, *m.split(".")))}
# the extension module (_C): a submodule, but no Python source, outside the graph
EXTENSIONS = {f.split(".")[0] for f in os.listdir(PKG) if f.endswith(".so")} | {"_C"}
MAX_LINES = 550


def _path(mod):
    if mod == "__init__":
        return os.path.join(PKG, "__init__.py")
    p = os.path.join(PKG, *mod.split("."))
    return os.path.join(p, "__init__.py") if os.path.isdir(p) else p + ".py"


def _tree(mod):
    with open(_path(mod)) as f:
        return ast.parse(f.read(), _path(mod))


def _package_of(mod):
    """The package mod's relative imports start from ("" for the top level)."""
    if mod in PACKAGES:
        return mod
    return mod.rpartition(".")[0] if "." in mod else ""


def _known(name):
    """name (dotted, under pyddp) as a module of the graph: itself, or the package
    (or module) that holds it; "__init__" for the top level."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return "__init__"


def _imports(mod):
    """The modules of the package that mod imports, anywhere in its body (deferred
    imports count)."""
    out = set()
    for node in ast.walk(_tree(mod)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(mod).split(".") if _package_of(mod) else []
                if node.level - 1 > len(base):
                    raise AssertionError(f"{mod}: relative import beyond the package")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "pyddp":
                target = node.module[len("pyddp."):] if "." in node.module else ""
            else:
                continue
            if target.split(".")[0] in EXTENSIONS:
                continue                              # from ._C import ...
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                if sub in MODULES:
                    out.add(sub)
                elif a.name in EXTENSIONS and not target:
                    continue
                else:
                    out.add(_known(target))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "pyddp":
                    out.add(_known(".".join(parts[1:])))
    out.discard(mod)
    return sorted(m for m in out if m in MODULES)


def _cycle(graph):
    """One import cycle of graph (a list of modules, the first repeated last), or None."""
    state = {}

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[m] = 2
        return None
    for m in graph:
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES}
    cyc = _cycle(graph)
    assert cyc is None, "import cycle: " + " -> ".join(cyc)


def test_elastic_is_a_plug_in():
    """The in-place elastic mode plugs into the world (``_world.WorldHooks``): no module
    outside pyddp/elastic/ imports it, deferred imports included."""
    bad = [f"{m} imports {d}" for m in MODULES if m != "elastic" and not m.startswith("elastic.")
           for d in _imports(m) if d == "elastic" or d.startswith("elastic.")]
    assert not bad, bad


def test_the_cycle_check_finds_a_deferred_cycle():
    """The check itself, on a graph with the shape of an old cycle (a module importing
    its importer inside a function)."""
    assert _cycle({"ddp": ["ddp._torch"], "ddp._torch": ["ddp"]}) == \
        ["ddp", "ddp._torch", "ddp"]
    assert _cycle({"a": ["b"], "b": ["c"], "c": []}) is None


@pytest.mark.parametrize("mod", MODULES)
def test_module_size_and_docstring(mod):
    with open(_path(mod)) as f:
        n = sum(1 for _ in f)
    assert n <= MAX_LINES, f"{_path(mod)} has {n} lines (at most {MAX_LINES})"
    if mod != "_version":
        doc = ast.get_docstring(_tree(mod))
        assert doc and len(doc.split()) >= 5, f"{_path(mod)} has no header docstring"


def _env_reads(mod):
    """(line, name) of every environment lookup of a PYDDP_* name in mod."""
    tree = _tree(mod)
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    consts[t.id] = node.value.value

    def name_of(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        return None

    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ" or \
            isinstance(n, ast.Name) and n.id == "environ"

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and is_environ(f.value) or
                    f.attr == "getenv") and node.args:
                key = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and \
                not isinstance(node.ctx, ast.Store):     # setting one for children is no read
            key = name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = name_of(node.left)
        if key and key.startswith("PYDDP_"):
            found.append((node.lineno, key))
    return found


def test_settings_are_read_only_through_the_table():
    bad = [f"{_path(m)}:{line}: {key}" for m in MODULES for line, key in _env_reads(m)]
    assert not bad, "PYDDP_* read outside _C.setting/_C.setting_text:\n" + "\n".join(bad)


def test_the_env_check_sees_each_spelling(tmp_path, monkeypatch):
    """The check itself: each way of reading a variable is caught."""
    src = ("import os\nNAME = 'PYDDP_X'\n"
           "a = os.environ.get('PYDDP_A')\nb = os.environ['PYDDP_B']\n"
           "c = 'PYDDP_C' in os.environ\nd = os.getenv('PYDDP_D')\ne = os.environ.get(NAME)\n"
           "f = os.environ.get('OTHER')\n")
    (tmp_path / "m.py").write_text(src)
    monkeypatch.setattr(__import__(__name__), "PKG", str(tmp_path))
    assert [k for _, k in _env_reads("m")] == ["PYDDP_A", "PYDDP_B", "PYDDP_C", "PYDDP_D",
                                               "PYDDP_X"]


def test_every_setting_python_reads_is_declared():
    """The names Python asks the table for are in it (a misspelt one raises KeyError
    at run time, maybe only on an error path)."""
    from pyddp import _C
    declared = {s["name"] for s in _C.settings()}
    asked = set()
    for m in MODULES:
        for node in ast.walk(_tree(m)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("setting", "setting_text") and node.args and \
                    isinstance(node.args[0], ast.Constant):
                asked.add(node.args[0].value)
    assert asked and asked <= declared, sorted(asked - declared)


# ---- the forensics store schema -------------------------------------------------------

def _fields_of_format(fmt):
    return [part.split("=", 1)[0] for part in fmt.split(";")]


def test_forensics_formats_and_field_lists_agree():
    from pyddp import _C
    for fields, fmt in ((_C.FX_STUCK_FIELDS, _C.FX_STUCK_FORMAT),
                        (_C.FX_BROKEN_FIELDS, _C.FX_BROKEN_FORMAT)):
        assert _fields_of_format(fmt) == fields.split(";"), (fields, fmt)
        assert fields.split(";")[-1] == "what"      # the free text comes last


def test_a_record_written_by_the_c_format_reads_back():
    """Independent reference: the record the C worker's format makes (printf rules, the
    C length modifiers dropped for Python's %), parsed by _forensics."""
    from pyddp import _C, _forensics
    what = "all_reduce timed out; a peer may be stuck (rank=1;seq=9) on rank 0"
    text = re.sub(r"ll([xud])", r"\1", _C.FX_STUCK_FORMAT) % (3, 0xABCDEF0123456789, 42, what)
    assert text.startswith("rank=3;tag=abcdef0123456789;seq=42;what=")
    rec = _forensics._parse(text)
    assert (rec["rank"], rec["tag"], rec["seq"], rec["what"]) == (3, 0xABCDEF0123456789, 42,
                                                                  what)
    assert rec["what_short"] == "all_reduce timed out; a peer may be stuck (rank=1;seq=9)"
    text = re.sub(r"ll([xud])", r"\1", _C.FX_BROKEN_FORMAT) % (5, what)
    assert _forensics._parse_broken(text) == {"rank": 5, "what": what}
    with pytest.raises(ValueError):
        _forensics._parse("rank=3;seq=42;tag=00;what=x")       # fields out of order
    with pytest.raises(ValueError):
        _forensics._parse_broken("rank=5")


def test_forensics_keys_follow_the_schema():
    from pyddp import _C, _forensics as F
    k = _C.FX_KEYS
    assert F._stuck_n_key("/p") == f"/p/{k['incidents']}"
    assert F._report_key(F._stuck_key("/p", 7), 2) == f"/p/{k['incident']}/7/{k['report']}/2"
    assert F._read_key("/p", 0xAB, 4) == f"/p/{k['incident']}/{k['read']}/00000000000000ab/4"
    assert F._broken_key("/p", 3) == f"/p/{k['failure']}/3"
    assert F._broken_key("/p") == f"/p/{k['failure']}"


def _code_strings(path):
    """String literals of a Python file outside docstrings and comments."""
    tree = ast.parse(open(path).read())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and
            isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and
            isinstance(n.value, str) and id(n) not in docs]


def test_no_other_source_spells_the_records_out():
    """Keys and record formats come from ddp_forensics.h only: the C sources use its
    macros, the Python layer its _C constants."""
    spelled = re.compile(r"stuck_n|broken_n|rank=%d;|;what=|/stuck/|/broken/|/report/")
    bad = []
    for d in ("csrc/core", "csrc/py"):
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith((".c", ".h")) and f != "ddp_forensics.h":
                src = open(os.path.join(ROOT, d, f)).read()
                code = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
                bad += [f"{d}/{f}: {m}" for m in spelled.findall(code)]
    for m in MODULES:
        bad += [f"{_path(m)}: {s!r}" for s in _code_strings(_path(m))
                if spelled.search(s)]
    assert not bad, bad
