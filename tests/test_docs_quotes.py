"""docs/troubleshooting.md quotes pyddp's error messages so that a user can search the
page for what they see: each quote must be verbatim from the code, or the page lies.

Quoted messages are the page's headings in double quotes, its `>` lines and its inline
code spans that read as a message (a colon and at least six words). Runtime values
differ from run to run, so on both sides numbers, addresses and ports become "...", as
do the format fields of the source's strings (%s, {name}); "..." in a quote stands for
any such part. The source side is every string literal of pyddp/ and csrc/ with
adjacent literals joined, as the compiler and Python join them.
"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "troubleshooting.md")

_LIT = r'''(?:[rRfFbBuU]{0,2}(?:"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'))'''
_RUN = re.compile(rf"{_LIT}(?:\s*{_LIT})*")
_ONE = re.compile(_LIT)


def _normal(text):
    """Values and format fields as "...", runs of them as one, spaces collapsed."""
    text = re.sub(r"%[-+ #0-9.*]*(?:hh|h|ll|l|z|j|t)?[diouxXeEfgGcsp]", "...", text)
    text = re.sub(r"\{[^{}]*\}", "...", text)
    text = re.sub(r"\b\d+(?:\.\d+)*\b", "...", text)
    text = text.replace("…", "...")
    text = re.sub(r"\.\.\.(?:[\s.:\[\]/-]*\.\.\.)*", "...", text)
    return re.sub(r"\s+", " ", text).strip()


def source_messages():
    """Every string (adjacent literals joined) of the C core and the Python package."""
    out = []
    files = glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True) + \
        glob.glob(os.path.join(ROOT, "pyddp", "**", "*.py"), recursive=True)
    for path in files:
        text = open(path, encoding="utf-8").read()
        for run in _RUN.finditer(text):
            parts = []
            for lit in _ONE.finditer(run.group(0)):
                body = lit.group(0).lstrip("rRfFbBuU")[1:-1]
                parts.append(body.replace('\\"', '"').replace("\\'", "'").replace("\\n", " "))
            out.append(_normal("".join(parts)))
    return out


def doc_quotes():
    """The quoted messages of troubleshooting.md, in the page's words (code blocks are
    example output, kept in step by the tests that produce them)."""
    quotes, prose = [], []
    in_code = False
    for line in open(DOC, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("#"):
            quotes += re.findall(r'"([^"]+)"', line)
        elif line.startswith("> "):
            quotes.append(line[2:].strip().strip('"'))
        else:
            prose.append(line.rstrip("\n"))
    # code spans may wrap onto the next line: look for them in whole paragraphs
    for para in " ".join(x if x.strip() else "\n" for x in prose).split("\n"):
        quotes += [re.sub(r"\s+", " ", q) for q in re.findall(r"`([^`]+)`", para)
                   if ": " in q and len(q.split()) >= 6]
    return quotes


MIN_PIECE = 8   # characters: shorter pieces of a quote say nothing about the source


def covered(quote, corpus):
    """Whether quote is made of source text: each part between "..." is a run of pieces,
    each piece (at least MIN_PIECE characters, or the whole rest of the part; or one
    punctuation character or space) verbatim in one source string. Pieces, not the whole part, since messages are composed: a
    collective's prefix, the link's direction and peer, the transport's reason."""
    for part in (f.strip() for f in _normal(quote).split("...")):
        i = 0
        while i < len(part):
            lo, hi = 0, len(part) - i      # longest prefix of part[i:] found in a string
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if part[i:i + mid] in corpus:
                    lo = mid
                else:
                    hi = mid - 1
            if lo >= min(MIN_PIECE, len(part) - i):
                i += lo
            elif not part[i].isalnum():   # joints such as "; " come from their own literal
                i += 1
            else:
                return False
    return True


def test_every_quoted_message_is_in_the_source():
    corpus = "\0".join(source_messages())
    quotes = doc_quotes()
    assert len(quotes) >= 10, quotes
    missing = [q for q in quotes if not covered(q, corpus)]
    assert not missing, "quoted in docs/troubleshooting.md but not found in the source:\n" + \
        "\n".join(missing)


def test_the_check_can_fail():
    corpus = "\0".join(source_messages())
    assert covered("could not connect to 10.0.0.1:23456 within 3.5 s", corpus)
    assert not covered("could not frobnicate the store at 10.0.0.1:23456", corpus)
    assert not covered("no answer from rank 1 at 10.0.0.7 for 15 s: the host is on fire", corpus)


# ---- the docs as a whole: README.md, CHANGELOG.md and docs/*.md -------------------------

DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")] + \
    sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _rel(path):
    return os.path.relpath(path, ROOT)


def _lines(path):
    return open(path, encoding="utf-8").read().splitlines()


def test_docs_speak_of_the_project_alone():
    """No development machine's paths, no issue numbers, no commit hashes (a word of 7 to
    12 or of 40 hex digits with letters and digits both: group tags in examples of
    flight records have 16)."""
    bad = re.compile(r"(?:^|[\s`(\"'])/(?:work|root|home)/[A-Za-z]|\b[Ii]ssues? #?\d+\b|"
                     r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")
    found = [f"{_rel(p)}:{i + 1}: {line.strip()[:120]}" for p in DOCS
             for i, line in enumerate(_lines(p)) if bad.search(line)]
    assert not found, "\n".join(found)


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lstrip("#").strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path):
    out, counts, in_code = set(), {}, False
    for line in _lines(path):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            s = _slug(line)
            n = counts.get(s, 0)
            counts[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_relative_links_resolve():
    """Every relative link names a file of the repository, and its #anchor a heading."""
    broken = []
    for p in DOCS:
        text = re.sub(r"```.*?```", "", open(p, encoding="utf-8").read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(p), file)) if file else p
            if not os.path.exists(dest):
                broken.append(f"{_rel(p)}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{_rel(p)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _script_variables():
    """The PYDDP_* variables scripts/*.sh read (PYDDP_VENV): the README's knobs, not
    pyddp's settings."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "scripts", "*.sh")):
        names |= set(re.findall(r"\$\{?(PYDDP_[A-Z0-9_]*[A-Z0-9])", open(path).read()))
    return names


def test_every_pyddp_variable_named_is_a_setting():
    """Each PYDDP_* name the docs mention is in the settings table (docs/env.md's rows
    are checked against it by tests/c/test_settings.c), or is a variable of
    scripts/*.sh."""
    from pyddp import _C
    known = {s["name"] for s in _C.settings()} | _script_variables()
    unknown = sorted({(name, _rel(p)) for p in DOCS
                      for name in re.findall(r"\bPYDDP_[A-Z0-9_]*[A-Z0-9]\b",
                                             open(p, encoding="utf-8").read())
                      if name not in known})
    assert not unknown, unknown


# wrappers that pass their other arguments on to a script of the repository
_PASS_ON = {"scripts/train.sh": "examples/train.py", "benchmarks/one_host.sh": "pyddp/bench.py"}

_PLACEHOLDER = re.compile(r"\$|<|\[-|=G\b|=N\b|=i\b|\bIP\b|=IP|\bMIN:MAX\b")


def _module_file(module):
    """The file `python -m module` runs: module.py, or a package's __main__.py."""
    path = os.path.join(ROOT, *module.split("."))
    return path + ".py" if not os.path.isdir(path) else os.path.join(path, "__main__.py")


def _module_source(script):
    """A script's text; for a package's __main__.py, every module of the package (its
    options are defined beside it)."""
    if os.path.basename(script) != "__main__.py":
        return open(script, encoding="utf-8").read()
    return "".join(open(f, encoding="utf-8").read()
                   for f in sorted(glob.glob(os.path.join(os.path.dirname(script), "*.py"))))


def _commands():
    """(doc, command) for each command line the docs show, in code blocks (with their
    continuation lines) and in code spans, that starts python/torchrun/bash."""
    out = []
    for p in DOCS:
        text = open(p, encoding="utf-8").read()
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
            for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
                out.append((p, cmd.split("  #")[0].strip()))
        for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            out.append((p, span.strip()))
    start = re.compile(r"(?:\.venv/bin/)?(?:python3?|torchrun|bash) ")
    return [(p, c) for p, c in out if start.match(c)]


def test_command_lines_name_real_scripts_and_options():
    """Each command that can run on one machine (no placeholder such as G, N, IP or
    $VAR) names a script or module of the repository that exists, and every --option it
    passes to that script is one the script defines."""
    wrong, checked = [], 0
    for p, cmd in _commands():
        if _PLACEHOLDER.search(cmd):
            continue
        words = cmd.split()
        script, rest = None, []
        for i, w in enumerate(words):
            if w.endswith((".py", ".sh")) and not w.startswith("-"):
                if "/" in w:                 # a bare train.py is the user's own script
                    script, rest = os.path.join(ROOT, w), words[i + 1:]
                break
            if w == "-m" and i + 1 < len(words) and words[i + 1].startswith("pyddp."):
                script = _module_file(words[i + 1])
                rest = words[i + 2:]
                break
        if script is None:
            continue
        checked += 1
        if not os.path.exists(script):
            wrong.append(f"{_rel(p)}: {cmd} ({_rel(script)} does not exist)")
            continue
        src = _module_source(script)
        target = _PASS_ON.get(_rel(script))
        if target:
            src += open(os.path.join(ROOT, target), encoding="utf-8").read()
        if rest and "--" in rest:            # options after "--" go to another program
            rest = rest[:rest.index("--")]
        for w in rest:
            opt = w.split("=")[0]
            if opt.startswith("--") and f'"{opt}"' not in src and f"'{opt}'" not in src:
                wrong.append(f"{_rel(p)}: {cmd} ({opt} is not an option of {_rel(script)})")
    assert checked >= 10, checked
    assert not wrong, "\n".join(wrong)


# ---- what a newcomer follows: README, the per-node recipe, performance.md ---------------

STATIC_LINE = ("torchrun --nproc_per_node=G --nnodes=N --node_rank=i --master_addr=IP "
               "--master_port=23456 train.py")
C10D_LINE = ("torchrun --rdzv-id=0 --rdzv-backend=c10d --rdzv-endpoint=$MASTER:29500 "
             "--nnodes=N --nproc_per_node=G train.py")


def _read(*parts):
    return open(os.path.join(ROOT, *parts), encoding="utf-8").read()


def _list_item(text, start):
    """The numbered list item of text that starts with `start`, up to the next line that
    is neither blank nor indented."""
    i = text.index(start)
    lines, out = text[i:].splitlines(), []
    for n, line in enumerate(lines):
        if n and line.strip() and not line.startswith(" "):
            break
        out.append(line)
    return "\n".join(out)


def _section(text, heading):
    """From heading to the next heading (outside code blocks) of the same or a higher
    level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text[text.index(heading + "\n"):].splitlines()
    out, in_code = [lines[0]], False
    for line in lines[1:]:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(rf"#{{1,{level}}} ", line):
            break
        out.append(line)
    return "\n".join(out)


def test_readme_step_5_holds_both_launch_lines():
    item = re.sub(r"[ \t]+", " ", _list_item(_read("README.md"), "5. **Launch"))
    assert STATIC_LINE in item and C10D_LINE in item, item
    assert "PYDDP_PORT_RANGE=" in item, "the static line needs the data ports' range"
    assert "docs/multi-vm.md#the-per-node-recipe" in item
    assert "docs/elastic.md" in item


def test_readme_cpu_torch_comes_before_the_first_command():
    text = _read("README.md")
    assert text.index("download.pytorch.org/whl/cpu") < text.index("bash scripts/train.sh")


def test_readme_says_how_long_the_tests_take_and_what_they_skip_without_root():
    text = _read("README.md")
    tests = text[text.index("bash scripts/test.sh"):text.index("## Your own script")]
    assert re.search(r"\d+ (?:s|minutes)\b", tests), "no duration"
    assert "root" in tests
    netns = _read("tests", "netns.py")
    for reason in re.findall(r'\("([^"]+)"\)', tests):     # quoted skip reasons
        assert reason in netns or reason in _read("tests", "gpu", "conftest.py"), reason


def test_readme_wheel_step_names_its_limits():
    step = _list_item(_read("README.md"), "1. **The same build")
    assert "pip wheel" in step and "Python" in step and "architecture" in step


def test_lightning_strategy_name_comes_with_its_import():
    """strategy="ddp_pyddp" exists only after `import pyddp.lightning`: every code block
    of the docs that uses the name imports it."""
    wrong = []
    for p in DOCS:
        for block in re.findall(r"```[^\n]*\n(.*?)```", open(p, encoding="utf-8").read(), re.S):
            if 'strategy="ddp_pyddp"' in block and "import pyddp.lightning" not in block:
                wrong.append(f"{_rel(p)}: {block.strip()[:80]}")
    assert not wrong, "\n".join(wrong)
    assert "num_nodes" in _read("README.md")


def test_per_node_recipe_is_complete_for_each_form():
    text = _section(_read("docs", "multi-vm.md"), "## The per-node recipe")
    forms = {"### Static form": STATIC_LINE, "### c10d form": C10D_LINE,
             "### Cluster platform": "VC_WORKER_HOSTS"}
    for heading, line in forms.items():
        head = next(h for h in re.findall(r"^### .*$", text, re.M) if h.startswith(heading))
        part = _section(text, head)
        flat = re.sub(r"\\\n\s*", " ", part)
        assert line in flat, heading
        assert "PYDDP_AUTH_TOKEN" in part, heading
        assert "pyddp.doctor" in part, heading
        assert "pip install" in part, heading
        assert re.search(r"security group|Rule", part, re.I), heading
        if heading != "### c10d form":
            assert "PYDDP_PORT_RANGE=" in part, heading
        if heading != "### Cluster platform":      # the doctor alone, then under torchrun
            assert "--listen" in part and line.replace("train.py", "-m pyddp.doctor") in flat


def test_performance_page_is_for_users():
    text = _read("docs", "performance.md")
    assert len(text.splitlines()) <= 430, "performance.md: at most 430 lines (it gained the GPU and etcd figures)"
    for word in ("not met", "before the change", "goal", "both parts"):
        assert word not in text.lower(), word


_PREFIX = re.compile(r"^(?:sudo |nice -n -?\d+ |[A-Z_]+=\S* )*")


def _doc_commands(path):
    """Every command line of a doc, code blocks and code spans, prefixes kept."""
    text = open(path, encoding="utf-8").read()
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        out += [c.split("  #")[0].strip() for c in re.sub(r"\\\n\s*", " ", block).splitlines()]
    out += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    start = re.compile(r"(?:python3?|torchrun|bash|benchmarks/\S+) ")
    return [c for c in out if start.match(_PREFIX.sub("", c))]


def test_performance_commands_name_files_that_exist_and_ask_for_root():
    """Each command of performance.md names files of the repository that exist (with or
    without placeholders), and those that make network namespaces start with sudo."""
    cmds = _doc_commands(os.path.join(ROOT, "docs", "performance.md"))
    assert len(cmds) >= 10, cmds
    wrong = []
    for cmd in cmds:
        for w in cmd.split():
            if re.fullmatch(r"[\w./-]+/[\w.-]+\.(?:py|sh)", w) and \
                    not os.path.exists(os.path.join(ROOT, w)):
                wrong.append(f"{cmd} ({w} does not exist)")
        needs_root = "two_hosts.py" in cmd or ("plots.py" in cmd and "--from-json" not in cmd
                                               and "one_host" not in cmd)
        if needs_root and not cmd.startswith("sudo "):
            wrong.append(f"{cmd} (network namespaces need root: sudo)")
    assert not wrong, "\n".join(wrong)


def test_docs_commands_with_sudo_name_real_options_too():
    """The commands test above skips lines that start with sudo or VAR=...: check their
    scripts' options the same way."""
    wrong = []
    for p in DOCS:
        for cmd in _doc_commands(p):
            bare = _PREFIX.sub("", cmd)
            if bare == cmd or _PLACEHOLDER.search(bare):
                continue
            words = bare.split()
            script = next((w for w in words if re.fullmatch(r"[\w./-]+/[\w.-]+\.(?:py|sh)", w)),
                          None)
            if script is None or not os.path.exists(os.path.join(ROOT, script)):
                continue
            src = _read(script) + (_read(_PASS_ON[script]) if script in _PASS_ON else "")
            rest = words[words.index(script) + 1:]
            rest = rest[:rest.index("--")] if "--" in rest else rest
            wrong += [f"{_rel(p)}: {cmd} ({w})" for w in rest if w.startswith("--")
                      and f'"{w.split("=")[0]}"' not in src]
    assert not wrong, "\n".join(wrong)


def test_train_backend_choices_match_its_help():
    """examples/train.py --backend: the help names exactly the choices, and pyddp takes
    each of them."""
    import ast
    from pyddp import _group
    tree = ast.parse(_read("examples", "train.py"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") == "add_argument"
                and n.args and getattr(n.args[0], "value", None) == "--backend")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    choices, help_text = kw["choices"], kw["help"]
    names = {"auto", "cpu", "gloo", "nccl", "mpi", "ucc"}
    assert {w for w in re.findall(r"\w+", help_text) if w in names} == set(choices), help_text
    for c in choices:
        _group._pick_backend(c, check=False)


def test_no_doc_says_ddp_needs_the_default_group():
    """pyddp's DDP takes any group (process_group=, tested in tests/workers/ddp_parity.py)."""
    found = [_rel(p) for p in DOCS if re.search(r"groups?\s+other\s+than\s+the\s+default",
                                                open(p, encoding="utf-8").read())]
    assert not found, found


def test_gpu_page_says_it_is_untested_while_the_others_do():
    """While torch-backend.md or lightning.md says the GPU path has not been run by the
    tests, docs/gpu.md says so before its first section."""
    others = [_read("docs", f) for f in ("torch-backend.md", "lightning.md")]
    if any("has not been run" in t for t in others):
        top = _read("docs", "gpu.md").split("\n## ")[0]
        assert re.search(r"not (?:yet )?(?:been )?run on a GPU", top, re.I), top[:300]


def test_no_docstring_puts_the_restart_count_in_the_key_prefix():
    """The key prefix is the agreed round (_round), not TORCHELASTIC_RESTART_COUNT."""
    import ast
    wrong = []
    for path in glob.glob(os.path.join(ROOT, "pyddp", "*.py")):
        tree = ast.parse(open(path, encoding="utf-8").read())
        docs = [ast.get_docstring(n) or "" for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for sentence in re.split(r"(?<=[.;])\s", re.sub(r"\s+", " ", " ".join(docs))):
            low = sentence.lower()
            if ("restart count" in low or "restart_count" in low) and "part of" in low \
                    and "prefix" in low and " not " not in low:
                wrong.append(f"{_rel(path)}: {sentence[:160]}")
    assert not wrong, "\n".join(wrong)
