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
