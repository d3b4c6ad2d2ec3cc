"""Documents: files and folders -> [(name, text)] for a knowledge base, bounded and checked.

Any UTF-8 text is a document (prose, source code of any language, JSON, YAML, TOML, CSV,
HTML, ...). A file is refused as binary by its content, not its suffix: a NUL byte, or
bytes that are not UTF-8. Sizes are bounded before any file is read whole.

`select_documents(paths, include=, exclude=)` takes files and folders in order:

- A named file is always read; binary, empty, unreadable or missing is an error naming it.
- A named folder is walked recursively, its files sorted by path (so two publishes of the
  same tree give the same KB and share every chunk). The walk skips hidden entries (names
  starting with '.': .git, .venv, .env), `SKIP_DIRS` (__pycache__, node_modules), symlinked
  folders (never followed: no loops), symlinked files whose target lies outside the folder,
  and files that are not regular (FIFOs, sockets). Binary and empty (whitespace-only) files
  found by the walk are skipped and counted, not fatal: a repository has images and empty
  `__init__.py` files. `include`/`exclude` globs select among the walked files (see
  `matches`); an explicitly named file is not filtered by them.
- Each document's name is its path relative to the root: the folder, when one folder is
  named; otherwise the deepest folder holding everything named (`kdn/data/0*.md` gives
  `01-declaration.md`, ...; `a/x.py b/x.py` gives `a/x.py` and `b/x.py`: never a collision).
  Names use '/' and are valid manifest document names (kdn.core.manifest: a non-empty str of at
  most MAX_DOC_NAME characters, none of them a control or bidirectional-control character,
  kdn.core.names.unsafe_char); a file whose name is not is refused, naming it.
- Paths named twice count once: a folder named twice is walked once, a file reached twice
  (named and walked, or by two overlapping folders) is read once, at its first place, and
  is treated as named if it was named anywhere; a skipped entry is counted once however
  often it was reached (skipped entries are kept by absolute path until the end).
- Nothing selected is a clear error, saying what was skipped and why.

`check_documents` checks (name, text) pairs given in Python the same way (names unique
and valid, texts non-empty, the total bounded), `join_documents` joins them into the text
of the knowledge turn, and `check_kb_tokens` says what a KB's length means: the origin's
limit (MAX_KB_TOKENS) and the model's context, which no prompt can exceed.
"""
import dataclasses
import os
import stat
from fnmatch import fnmatchcase
from pathlib import Path

from kdn.core.errors import BadRequest
from kdn.core.keys import MAX_TOKENS_PER_KB
from kdn.core.manifest import MAX_DOC_NAME
from kdn.core.names import unsafe_char

MAX_KB_TOKENS = MAX_TOKENS_PER_KB      # the origin refuses a longer KB
# Text is bounded before it is tokenized (tokenizing 50 MB takes GBs and tens of seconds):
# at 2 bytes per token, below what text averages (English ~4, code ~3), a KB past this bound
# is far past anything one prefill could compute (16M tokens of SmolLM2 KV are ~750 GB).
BYTES_PER_TOKEN = 2
MAX_KB_BYTES = MAX_KB_TOKENS * BYTES_PER_TOKEN
MAX_FILES = 100_000            # files one selection may consider (a walk of '/' stops here)
SNIFF_BYTES = 8192             # read first: binary content shows within it (NUL, not UTF-8)
SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
CONTEXT_ROOM = 512             # tokens of the context a question and its answer want at least

# skip reasons, in the order a summary names them
SKIPPED = ("binary", "empty", "symlink", "not a regular file")


@dataclasses.dataclass
class Selection:
    """What select_documents found: documents [(name, text)] in order, the files skipped
    by reason ({reason: [relative path, ...]}), the root names are relative to, the bytes."""
    documents: list
    skipped: dict
    root: Path
    bytes: int

    def summary(self) -> str:
        """'5 documents (88.3 KiB of text); skipped 1 binary, 2 empty' (skipped only if any)."""
        n = len(self.documents)
        line = f"{n} document{'s' * (n != 1)} ({self.bytes / 1024:.1f} KiB of text)"
        skipped = [f"{len(self.skipped[r])} {r}" for r in SKIPPED if self.skipped.get(r)]
        return line + ("; skipped " + ", ".join(skipped) if skipped else "")


# --- patterns --------------------------------------------------------------------------------
def _clean_pattern(pattern) -> str:
    if not isinstance(pattern, str) or not pattern.strip("/"):
        raise BadRequest(f"a glob must be a non-empty str, got {pattern!r}")
    p = pattern
    while p.startswith("./"):
        p = p[2:]
    return p.strip("/")


def matches(rel: str, pattern: str) -> bool:
    """Whether relative path rel ('pkg/sub/x.py') matches glob `pattern`.

    fnmatch rules, case-sensitive, with '*' crossing '/': 'tests/*' is everything under the
    top-level tests folder, 'pkg/*.py' every .py file below pkg. A pattern naming a folder
    matches all it holds ('docs/api' is 'docs/api/*'). A pattern without '/' matches any
    component of the path too, as in .gitignore: '*.py' every Python file at any depth,
    'tests' every folder named tests, 'test_*' every file or folder so named.
    """
    pattern = _clean_pattern(pattern)
    if fnmatchcase(rel, pattern) or fnmatchcase(rel, pattern + "/*"):
        return True
    return "/" not in pattern and any(fnmatchcase(part, pattern) for part in rel.split("/"))


# --- reading -----------------------------------------------------------------------------------
def binary_reason(data: bytes, complete: bool = True):
    """Why `data` is not UTF-8 text (None if it is): a NUL byte, or invalid UTF-8, with the
    byte offset. complete=False: data is a file's first bytes, so a character cut at the
    end is fine."""
    nul = data.find(b"\0")
    bad = None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if complete or e.start < len(data) - 3 or e.reason != "unexpected end of data":
            bad = e
    if bad is not None and (nul < 0 or bad.start < nul):     # the first problem, by offset
        return f"not UTF-8 text ({bad.reason} at byte {bad.start})"
    if nul >= 0:
        return f"binary content (a NUL byte at byte {nul})"
    return None


def _open_error(path, e: OSError) -> BadRequest:
    return BadRequest(f"{path}: cannot be read ({e.strerror or type(e).__name__})")


def _sniff(path: Path) -> "str | None":
    try:
        with open(path, "rb") as f:
            return binary_reason(f.read(SNIFF_BYTES), complete=False)
    except OSError as e:
        raise _open_error(path, e) from None


def _read_text(path: Path) -> tuple:
    """(text, None) or (None, why it is not UTF-8 text)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _open_error(path, e) from None
    why = binary_reason(data)
    if why:
        return None, why
    text = data.decode("utf-8")
    return (text[1:] if text.startswith("\ufeff") else text), None    # a BOM is not content


@dataclasses.dataclass
class _File:
    path: Path          # where to read it
    abs: str            # absolute path (not resolved: a named symlink keeps its name)
    named: bool         # named on the command line (errors), or found by a walk (skips)
    size: int = 0
    name: str = ""


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _walk(folder: Path, include, exclude, skipped: dict, out: list) -> None:
    """Append the folder's selected regular files, sorted by path, to out; skipped entries
    by absolute path to skipped[reason]."""
    top = os.path.abspath(folder)
    real_top = os.path.realpath(folder)

    def rel_of(p: str) -> str:
        return os.path.relpath(p, top).replace(os.sep, "/")

    def visit(d: str) -> None:
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise _open_error(d, e) from None
        for entry in entries:
            rel = rel_of(entry.path)
            if entry.name.startswith(".") or any(matches(rel, p) for p in exclude):
                continue                         # hidden or excluded: not counted, not read
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if os.path.isdir(target) or not os.path.isfile(target) or not _is_within(target, real_top):
                    skipped.setdefault("symlink", []).append(entry.path)   # folder, dangling, outside
                    continue
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in SKIP_DIRS:
                    visit(entry.path)
                continue
            try:
                st = entry.stat()             # the target's, for a symlink inside the tree
            except OSError as e:
                raise _open_error(entry.path, e) from None
            if not stat.S_ISREG(st.st_mode):
                skipped.setdefault("not a regular file", []).append(entry.path)
                continue
            if include and not any(matches(rel, p) for p in include):
                continue
            out.append(_File(Path(entry.path), os.path.abspath(entry.path), False, st.st_size))
            if len(out) > MAX_FILES:
                raise BadRequest(f"{folder}: more than {MAX_FILES} files selected; narrow the "
                                 f"selection with --include/--exclude")
    visit(top)


def _gather(paths, include, exclude) -> tuple:
    """([_File] in order, skipped, root): every path's files once, at its first place (named
    if it was named anywhere); skipped {reason: [absolute path, ...]}, possibly repeated."""
    files, skipped, roots, walked = [], {}, [], set()
    for p in paths:
        path = Path(p)
        if path.is_dir():
            roots.append(os.path.abspath(path))
            if roots[-1] not in walked:              # the same folder twice: walked once
                walked.add(roots[-1])
                _walk(path, include, exclude, skipped, files)
        elif path.is_file():
            roots.append(os.path.dirname(os.path.abspath(path)))
            files.append(_File(path, os.path.abspath(path), True, path.stat().st_size))
        elif path.exists():
            raise BadRequest(f"{path}: not a regular file or folder")
        else:
            raise BadRequest(f"{path}: no such file or folder")
    root = os.path.commonpath(roots) if roots else os.getcwd()
    unique = {}
    for f in files:
        first = unique.setdefault(f.abs, f)
        first.named = first.named or f.named
    return list(unique.values()), skipped, Path(root)


def _skipped_names(skipped: dict, root: Path) -> dict:
    """{reason: [name relative to root, ...]}: each entry once, sorted by path components."""
    out = {}
    for reason, paths in skipped.items():
        names = {os.path.relpath(p, root).replace(os.sep, "/") for p in paths}
        out[reason] = sorted(names, key=lambda n: n.split("/"))
    return out


def _shown(name: str) -> str:
    """name as a message may print it: quoted and escaped when it holds a character that
    would rewrite the message (a newline, a bidirectional control) or is not UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return repr(name)
    return repr(name) if unsafe_char(name) else name


def _name(f: _File, root: Path) -> str:
    name = os.path.relpath(f.abs, root).replace(os.sep, "/")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{f.path}: the file's name is not UTF-8; rename it or exclude it") from None
    if unsafe_char(name):
        raise BadRequest(f"{_shown(str(f.path))}: the document name {name!r} holds {unsafe_char(name)}; "
                         f"names may not hold control or bidirectional-control characters: rename it "
                         f"or exclude it")
    if len(name) > MAX_DOC_NAME:
        raise BadRequest(f"{f.path}: its path ({len(name)} characters) is longer than a document "
                         f"name may be ({MAX_DOC_NAME})")
    return name


def select_documents(paths, include=(), exclude=()) -> Selection:
    """Documents from files and folders, in order (see the module); BadRequest naming the
    file and the problem for anything refused, before any file is read whole."""
    paths = list(paths)
    include = [_clean_pattern(p) for p in include or ()]
    exclude = [_clean_pattern(p) for p in exclude or ()]
    if not paths:
        raise BadRequest("nothing to publish: give at least one file or folder")
    if (include or exclude) and not any(Path(p).is_dir() for p in paths):
        raise BadRequest("--include/--exclude select files inside folders, and no folder is given")
    files, skipped, root = _gather(paths, include, exclude)
    kept, total = [], 0
    for f in files:            # binary content shows in the first bytes: refused or skipped unsized
        why = _sniff(f.path)
        if why and f.named:
            raise BadRequest(f"{f.path}: {why}; only text files can be published")
        if why:
            skipped.setdefault("binary", []).append(f.abs)
            continue
        if f.named and f.size > MAX_KB_BYTES:
            raise BadRequest(f"{f.path}: {f.size} bytes, over the {MAX_KB_BYTES}-byte limit of one "
                             "knowledge base")
        total += f.size
        kept.append(f)
    if total > MAX_KB_BYTES:
        largest = sorted(kept, key=lambda f: -f.size)[:3]
        raise BadRequest(f"the documents reach {total} bytes, over the {MAX_KB_BYTES}-byte limit of one "
                         "knowledge base; largest: " + ", ".join(f"{f.path} ({f.size})" for f in largest))
    docs, size = [], 0
    for f in kept:
        name = _name(f, root)
        text, why = _read_text(f.path)
        if why:
            if f.named:
                raise BadRequest(f"{f.path}: {why}; only text files can be published")
            skipped.setdefault("binary", []).append(f.abs)
            continue
        if not text.strip():
            if f.named:
                raise BadRequest(f"{f.path}: the document is empty")
            skipped.setdefault("empty", []).append(f.abs)
            continue
        docs.append((name, text))
        size += len(text.encode("utf-8"))
    skipped = _skipped_names(skipped, root)
    if not docs:
        what = "; ".join(f"{len(skipped[r])} {r}: {', '.join(map(_shown, skipped[r][:3]))}"
                         + (" ..." if len(skipped[r]) > 3 else "")
                         for r in SKIPPED if skipped.get(r)) or "no files"
        filters = "".join(f" --include {p!r}" for p in include) + "".join(f" --exclude {p!r}" for p in exclude)
        raise BadRequest(f"nothing to publish: no text file in {', '.join(map(str, paths))}{filters} "
                         f"(skipped {what}; hidden entries and {', '.join(sorted(SKIP_DIRS))} are never walked)")
    return Selection(docs, skipped, root, size)


def read_documents(paths, include=(), exclude=()) -> list:
    """[(name, text)] from files and folders (select_documents' documents)."""
    return select_documents(paths, include, exclude).documents


# --- documents given in Python ----------------------------------------------------------
def check_documents(documents) -> list:
    """documents as [(name, text)]: names valid document names and unique, each text a
    non-empty str, together within MAX_KB_BYTES. Checked before anything is tokenized."""
    docs = list(documents)
    if not docs:
        raise BadRequest("nothing to publish: give at least one document")
    total, names = 0, set()
    for i, item in enumerate(docs):
        if not isinstance(item, (tuple, list)) or len(item) != 2 \
                or not isinstance(item[0], str) or not isinstance(item[1], str):
            raise BadRequest(f"documents[{i}] must be a (name, text) pair of str, got {item!r:.80}")
        name, text = item
        if not name or len(name) > MAX_DOC_NAME:
            raise BadRequest(f"documents[{i}] name must be a non-empty str of at most {MAX_DOC_NAME} "
                             f"characters, got {name!r:.80}")
        if unsafe_char(name):
            raise BadRequest(f"documents[{i}] name {name!r:.200} holds {unsafe_char(name)}; names may "
                             f"not hold control or bidirectional-control characters")
        if name in names:
            raise BadRequest(f"documents[{i}] name {name!r:.200} is given twice; names must be unique")
        names.add(name)
        # characters first (a lower bound of the UTF-8 bytes, free), then the bytes themselves
        total += len(text) if len(text) > MAX_KB_BYTES else len(text.encode("utf-8", "replace"))
        if total > MAX_KB_BYTES:
            raise BadRequest(f"documents[{i}] ({name!r:.200}): the documents reach {total} bytes, "
                             f"over the {MAX_KB_BYTES}-byte limit of one knowledge base")
        if not text.strip():
            raise BadRequest(f"documents[{i}] ({name!r:.200}) is empty")
    return [tuple(d) for d in docs]


def join_documents(documents) -> tuple:
    """(knowledge text, [(name, char start, char end)]) with documents separated by a blank line."""
    parts, spans, pos = [], [], 0
    for i, (name, text) in enumerate(documents):
        if i:
            parts.append("\n\n")
            pos += 2
        parts.append(text)
        spans.append((name, pos, pos + len(text)))
        pos += len(text)
    return "".join(parts), spans


# --- a KB's length -----------------------------------------------------------------------------
def model_context(model) -> "int | None":
    """The model's context length in tokens (its max_position_embeddings), None if unknown;
    model: a loaded model (its `hf`'s config) or kdn.engines.transformers.prompts.Text (its `config`)."""
    config = getattr(getattr(model, "hf", None), "config", None) or getattr(model, "config", None)
    n = getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def check_kb_tokens(kb: str, tokens: int, context: int = None, allow_over_context: bool = False,
                    flag: "str | None" = "--allow-over-context",
                    context_name: str = "max_position_embeddings") -> "str | None":
    """BadRequest if a KB of `tokens` tokens cannot be published: over the origin's limit
    (MAX_KB_TOKENS, always), or over the model's `context` (unless allow_over_context; flag
    names the override, None where there is none). Returns a warning line when the KB is
    published over the context or leaves a question little room in it, else None."""
    split = ("publish it as several KBs, each within the model's context with room for a question "
             "(e.g. one per package folder: kdn publish KB-PKG repo/PKG), or as a segments KB from "
             "Python (kdn.engines.transformers.blend.publish_segments: a prompt then blends the few documents it needs)")
    if tokens > MAX_KB_TOKENS:
        raise BadRequest(f"KB {kb!r} is {tokens} tokens, over the origin's limit of {MAX_KB_TOKENS} tokens "
                         f"per KB" + (f" (and far over the model's context of {context} tokens)" if context else "")
                         + f"; {split}")
    if not context:
        return None
    if tokens > context:
        if allow_over_context and flag:
            return (f"warning: KB {kb!r} is {tokens} tokens, longer than the model's context of {context} "
                    f"tokens ({context_name}): published as asked ({flag}), but no prompt can use it whole")
        raise BadRequest(f"KB {kb!r} is {tokens} tokens but the model's context is {context} tokens "
                         f"({context_name}): the origin would take it (up to {MAX_KB_TOKENS} tokens per KB), "
                         f"but no prompt could use it whole; {split}"
                         + (f"; or pass {flag} to publish it anyway" if flag else ""))
    if context - tokens < CONTEXT_ROOM:
        return (f"warning: KB {kb!r} is {tokens} tokens of the model's {context}-token context: "
                f"{context - tokens} are left for a question and its answer")
    return None
