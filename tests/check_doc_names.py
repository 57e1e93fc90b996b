#!/usr/bin/env python3
"""Every name the docs cite exists in the tree (issue 40: docs that state the present).

Reads README.md, docs/*.md and the READMEs under bench/ and dev/, and fails, naming file, line and
name, on each of these that the tree does not hold:
  - a path under a top-level folder of the repository (`src/cuda/dispatch.cu`, bench/device/stage.sh,
    in backticks or not): the file or folder; with a placeholder (<date>, *, an upper-case segment
    such as TARGET) some file must match; after `REV:` (`git show e087d56:dev/wip/x.patch`) the file
    must exist at REV in git history;
  - in backticks: a file name (`gemm_plan.h`) or partial path (`gemm/epilogue.cuh`) some tracked path
    ends with; a code identifier (has an underscore or is camelCase: `MM_WS_MIN_TOKENS`,
    `sm90_expert_ws_kernel`) some source file holds; a command-line flag (`--gemm`) some source file
    holds; `NAME = VALUE` where NAME is a constant: its #define has that value;
  - `DECISIONS N` anywhere in the tree (docs and code comments): entry N exists, and the entries are
    numbered 1, 2, 3, ... in order;
  - `SOMEDOC.md "Heading"` or `SOMEDOC "Heading"` anywhere in the tree: that doc has a heading holding it.
Ordinary words in backticks (`wgmma`, `auto`, `bf16`) are not names and are not checked.
tests/doc_names_allow.txt lists the names that may be cited without being in the tree, each with its
reason; an entry nothing needs any more is itself a failure, so the list cannot rot.

    usage: check_doc_names.py [--root DIR] [DOC.md ...]      exit 0 clean, 1 with the failures listed
"""
import argparse
import os
import re
import subprocess
import sys

CODE_EXT = (".c", ".h", ".cu", ".cuh", ".py", ".sh", ".cmake", ".txt", ".toml", ".map", ".supp", ".clang-format")
FILE_EXT = r"\.(c|h|cu|cuh|py|sh|md|cmake|toml|txt|map|supp|patch)$"  # source files (not data: .json, .jsonl, ...)
FILE_RE = re.compile(r"^[\w.+-]+" + FILE_EXT)
ALLOW = "tests/doc_names_allow.txt"
# Dotted names under these are other projects' (torch.compile, np.float32), not this tree's.
EXTERNAL_MODULES = {"torch", "nn", "np", "numpy", "ctypes", "struct", "os", "sys", "transformers", "vllm",
                    "triton", "safetensors", "ml_dtypes", "pytest"}
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
CONST_RE = re.compile(r"^([A-Z][A-Z0-9_]*_[A-Z0-9_]+)\s*=\s*(-?[\w.]+)$")
HEAD_RE = re.compile(r"^#+\s+(.*)$")
DEC_RE = re.compile(r"DECISIONS(?:\.md)?,?\s+(\d{1,3}(?!\d)(?:\s*(?:[-–,]|and)\s*\d{1,3}(?![\d-]))*)")
SECTION_RE = re.compile(r"\b(BENCHMARKS|CUDA_BACKEND|CPU_BACKEND|DECISIONS|MULTINODE|PYTHON|ROADMAP|SPEC|TESTING|VLLM)"
                        r"(?:\.md)?,?\s+\"([^\"]{3,60})\"")


def sh(root, *args):
    try:
        return subprocess.run(args, cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def tree_files(root):
    """Tracked files and new ones git does not ignore; without git, every file under root."""
    out = sh(root, "git", "ls-files", "--cached", "--others", "--exclude-standard")
    if out is not None:
        return sorted(p for p in set(out.splitlines()) if os.path.exists(os.path.join(root, p)))
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and not x.startswith("build")]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(files)


class Tree:
    def __init__(self, root):
        self.root = root
        self.files = tree_files(root)
        self.fileset = set(self.files)
        self.dirs = {os.path.dirname(p) for p in self.files}
        for d in list(self.dirs):
            while d:
                self.dirs.add(d)
                d = os.path.dirname(d)
        self.top = {p.split("/")[0] for p in self.files if "/" in p}
        self.basenames = {os.path.basename(p) for p in self.files}
        self.idents, self.flags, self.defines = set(), set(), {}
        for p in self.files:
            if not p.endswith(CODE_EXT) and os.path.basename(p) not in ("Makefile", "CMakeLists.txt", "run"):
                continue
            if p.startswith(("bench/history/", "tests/fuzz/corpus/")) or p == ALLOW:
                continue  # data, and the allow-list (its names are the ones the tree lacks)
            try:
                text = open(os.path.join(root, p), encoding="utf-8", errors="replace").read()
            except OSError:
                continue
            self.idents.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
            self.flags.update(FLAG_RE.findall(text))
            for name, value in re.findall(r"^\s*#\s*define\s+([A-Z][A-Z0-9_]*)\s+\(?([-\w.]+)", text, re.M):
                self.defines.setdefault(name, set()).add(value)
        self.git = sh(root, "git", "rev-parse", "--git-dir") is not None
        self._at_rev = {}

    def path_ok(self, p):
        p = p.rstrip("/")
        return p in self.fileset or p in self.dirs

    def pattern_ok(self, p):
        """A path with placeholders: <x>, *, {..}, ..., or upper-case segments (TARGET, NAME, DATE)."""
        rx = ""
        for seg in re.split(r"(<[^>]*>|\*|\{[^}]*\}|…|\.\.\.|\b[A-Z][A-Z0-9_]{2,}\b)", p.rstrip("/")):
            if not seg:
                continue
            rx += r"[^/]*" if re.fullmatch(r"<[^>]*>|\*|\{[^}]*\}|…|\.\.\.|[A-Z][A-Z0-9_]{2,}", seg) else re.escape(seg)
        r = re.compile(rx + r"(/.*)?$")
        return any(r.match(f) for f in self.files)

    def at_rev(self, rev, path):
        if not self.git:
            return True  # an exported tree has no history to check against
        key = (rev, path.rstrip("/"))
        if key not in self._at_rev:
            self._at_rev[key] = sh(self.root, "git", "cat-file", "-e", f"{rev}:{key[1]}") is not None
        return self._at_rev[key]


def doc_files(root, tree):
    docs = ["README.md"] + sorted(p for p in tree.files if re.fullmatch(r"docs/[^/]+\.md", p))
    docs += sorted(p for p in tree.files if re.fullmatch(r"(bench|dev)/(.+/)?README\.md", p))
    return [d for d in docs if d in tree.fileset]


def load_allow(path):
    """[FILE:]NAME  # reason -- one per line; 'temporary' in the reason marks an entry for a merge."""
    allow = {}
    if not os.path.exists(path):
        return allow, []
    bad = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        entry, _, reason = line.partition("#")
        entry, reason = entry.strip(), reason.strip()
        if not reason:
            bad.append(f"{os.path.basename(path)}:{n}: `{entry}` has no reason")
            continue
        allow[entry] = [reason, False]
    return allow, bad


class Checker:
    def __init__(self, tree, allow):
        self.tree, self.allow, self.failures = tree, allow, []

    def allowed(self, doc, name):
        for key in (f"{doc}:{name}", name):
            if key in self.allow:
                self.allow[key][1] = True
                return True
        return False

    def fail(self, doc, n, name, why):
        if not self.allowed(doc, name):
            self.failures.append(f"{doc}:{n}: `{name}`: {why}")

    def check_path(self, doc, n, p, rev=None):
        p = re.sub(r":\d+(-\d+)?$", "", p.rstrip(".,;:)'\""))
        if rev:
            if not self.tree.at_rev(rev, p):
                self.fail(doc, n, f"{rev}:{p}", f"no such path at {rev} in git history")
            return
        if self.tree.path_ok(p):
            return
        if re.search(r"<[^>]*>|\*|\{|…|\.\.\.|(^|/|_)[A-Z][A-Z0-9_]{2,}(\.|/|$)", p) and self.tree.pattern_ok(p):
            return
        self.fail(doc, n, p, "no such file or folder in the tree")

    def check_span(self, doc, n, span):
        s = span.strip()
        for flag in FLAG_RE.findall(s):
            if flag not in self.tree.flags:
                self.fail(doc, n, flag, "no source file holds this flag")
        m = CONST_RE.match(s)
        if m:
            name, value = m.groups()
            if name in self.tree.defines:
                if value not in self.tree.defines[name]:
                    self.fail(doc, n, s, f"the code defines {name} as {'/'.join(sorted(self.tree.defines[name]))}")
            elif name not in self.tree.idents:
                self.fail(doc, n, name, "no source file holds this name")
            return
        if re.search(r"\s", s):
            return  # a command or a phrase: its paths and flags are checked
        # build outputs and ignored folders (.devbin/libs), $OUT/..., absolute paths, options
        if not s or s.startswith(("$", ".", "/", "~", "-")) or "://" in s:
            return
        s = s.rstrip(".,;:'\"")
        if "/" in s:
            head = s.split("/")[0]
            if head in self.tree.top or re.match(r"^[0-9a-f]{7,40}(\^|~\d+)?:", s):
                return  # checked as a path (REV:path against git history)
            if head.startswith("build") or re.fullmatch(r"[A-Z][A-Z0-9_]*", head):
                return  # an ignored build folder, or a path under a variable (FUZZ_DIR/...)
            if not (s.endswith("/") or re.search(FILE_EXT, s)):
                return  # not a path of the tree: a branch (wip/x), a unit (GB/s), names (w1/w3/w2)
            tail = s.rstrip("/")
            if "*" in tail or "<" in tail:
                ok = self.tree.pattern_ok("*/" + tail) or self.tree.pattern_ok(tail)
            else:
                ok = any(f == tail or f.endswith("/" + tail) for f in self.tree.files) or \
                     any(d == tail or d.endswith("/" + tail) for d in self.tree.dirs)
            if not ok:
                self.fail(doc, n, s, "no tracked path ends with this")
            return
        s = re.sub(r"\(.*\)$|<.*>$|\[.*\]$", "", s)  # f(), template<...>, array[...]
        s = s.split("=")[0] if re.match(r"^[A-Z][A-Z0-9_]*=", s) else s  # MEGAMOE_GEMM=ws
        if FILE_RE.match(s):
            if s not in self.tree.basenames:
                self.fail(doc, n, s, "no tracked file has this name")
            return
        parts = s.split(".") if "." in s else [s]
        if parts[0] in EXTERNAL_MODULES:
            return  # torch.library.opcheck, np.float32: another project's names
        for part in parts:
            if "*" in part:
                rx = re.compile(re.escape(part).replace(r"\*", r"\w*") + r"$")
                if "_" in part and not any(rx.match(i) for i in self.tree.idents):
                    self.fail(doc, n, part, "no source identifier matches this pattern")
                continue
            if not IDENT_RE.match(part) or not code_like(part):
                continue
            if part in self.tree.idents:
                continue
            # ctest's py_NAME tests are made by a CMake foreach from tests/py/test_NAME.py
            if part.startswith("py_") and f"tests/py/test_{part[3:]}.py" in self.tree.fileset:
                continue
            self.fail(doc, n, part, "no source file holds this name")


def code_like(w):
    """A name rather than a word: an underscore inside, or camelCase."""
    return "_" in w.strip("_") or (w.startswith("__") and len(w) > 4) or bool(re.search(r"[a-z][A-Z]", w))


def scan_doc(chk, tree, doc):
    text = open(os.path.join(tree.root, doc), encoding="utf-8").read()
    top = "|".join(sorted(map(re.escape, tree.top), key=len, reverse=True))
    path_re = re.compile(r"(?:(?<=[\s`(\[|,;\"'*])|^)(?:([0-9a-f]{7,40}(?:\^|~\d+)?):)?((?:%s)/[^\s`)\]|,;\"']*)" % top)
    for n, line in enumerate(text.splitlines(), 1):
        for rev, p in path_re.findall(line):
            chk.check_path(doc, n, p, rev or None)
        for span in re.findall(r"`([^`]+)`", line):
            chk.check_span(doc, n, span)


def decisions_entries(tree):
    path = os.path.join(tree.root, "docs/DECISIONS.md")
    if not os.path.exists(path):
        return None
    return [int(m) for m in re.findall(r"^(\d+)\. \*\*", open(path, encoding="utf-8").read(), re.M)]


def headings(tree, stem):
    path = os.path.join(tree.root, "docs", stem + ".md")
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read()
    heads = [m.group(1) for m in map(HEAD_RE.match, text.splitlines()) if m]
    return heads + re.findall(r"^\d+\. \*\*([^*]+)\*\*", text, re.M)


def scan_citations(chk, tree):
    """DECISIONS N and DOC "Heading" anywhere in the tree's text files."""
    entries = decisions_entries(tree)
    if entries is not None and entries != list(range(1, len(entries) + 1)):
        chk.failures.append(f"docs/DECISIONS.md: entries numbered {entries}, not 1..{len(entries)} in order")
    have = set(entries or [])
    for p in tree.files:
        if not (p.endswith(CODE_EXT + (".md",)) or os.path.basename(p) in ("Makefile", "CMakeLists.txt")):
            continue
        if p.startswith(("bench/history/", "tests/fuzz/corpus/")) or p == ALLOW:
            continue
        try:
            lines = open(os.path.join(tree.root, p), encoding="utf-8", errors="replace").read().splitlines()
        except OSError:
            continue
        for n, line in enumerate(lines, 1):
            if entries is not None:
                for group in DEC_RE.findall(line):
                    nums = []
                    for a, b in re.findall(r"(\d+)(?:\s*[-–]\s*(\d+))?", group):
                        nums += range(int(a), int(b or a) + 1)
                    for k in nums:
                        if k not in have:
                            chk.fail(p, n, f"DECISIONS {k}", f"docs/DECISIONS.md has no entry {k}")
            for stem, title in SECTION_RE.findall(line):
                heads = headings(tree, stem)
                if heads is not None and not any(title.lower() in h.lower() for h in heads):
                    chk.fail(p, n, f'{stem} "{title}"', f"docs/{stem}.md has no such heading")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--allow", help="allow-list (default tests/doc_names_allow.txt under the root)")
    ap.add_argument("docs", nargs="*", help="Markdown files to read (default: README.md, docs/*.md, bench/ and dev/ READMEs)")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    tree = Tree(root)
    allow, bad = load_allow(a.allow or os.path.join(root, ALLOW))
    chk = Checker(tree, allow)
    chk.failures += bad
    docs = a.docs or doc_files(root, tree)
    for doc in docs:
        scan_doc(chk, tree, os.path.relpath(os.path.abspath(doc), root) if a.docs else doc)
    scan_citations(chk, tree)
    if not a.docs:
        for key, (reason, used) in allow.items():
            if not used:
                chk.failures.append(f"tests/doc_names_allow.txt: `{key}` is allowed but no doc needs it any more")
            elif "temporary" in reason.lower():
                print(f"NOTE: allowed for now: `{key}` ({reason})")
    for f in chk.failures:
        print(f)
    print(f"check_doc_names: {len(docs)} docs, {len(tree.files)} files: "
          f"{'ok' if not chk.failures else f'{len(chk.failures)} name(s) not in the tree'}")
    return 1 if chk.failures else 0


if __name__ == "__main__":
    sys.exit(main())
