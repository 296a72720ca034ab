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


# ---- the docs as a whole: README.md and docs/*.md --------------------------------------

DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


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
_PASS_ON = {"scripts/train.sh": "examples/train.py"}

_PLACEHOLDER = re.compile(r"\$|<|\[-|=G\b|=N\b|=i\b|\bIP\b|=IP|\bMIN:MAX\b")


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
                script = os.path.join(ROOT, *words[i + 1].split(".")) + ".py"
                rest = words[i + 2:]
                break
        if script is None:
            continue
        checked += 1
        if not os.path.exists(script):
            wrong.append(f"{_rel(p)}: {cmd} ({_rel(script)} does not exist)")
            continue
        src = open(script, encoding="utf-8").read()
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
