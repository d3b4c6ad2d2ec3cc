"""The bundled knowledge base: public-domain documents shipped inside the kdn package.

`kdn demo` and the tests need a few thousand tokens of real text that anyone may copy and
that needs no network: five founding documents of the United States (kdn/data/0*.md, the
source of each named in kdn/data/SOURCES.md) and questions answered by them
(kdn/data/questions.txt). Files are read through importlib.resources, so this works from a
source checkout, an editable install and a wheel alike. Documents come in file-name order
(the numeric prefix), which is the order the prefix layout concatenates them in.
"""
from importlib import resources

DATA_PACKAGE = "kdn"
DATA_FOLDER = "data"
NOT_DOCUMENTS = {"SOURCES.md"}


def _data():
    return resources.files(DATA_PACKAGE) / DATA_FOLDER


def bundled_documents() -> list:
    """[(name, text)] of the bundled documents in order; name is the file stem without 'NN-'."""
    files = sorted((f for f in _data().iterdir()
                    if f.name.endswith(".md") and f.name not in NOT_DOCUMENTS), key=lambda f: f.name)
    out = []
    for f in files:
        stem = f.name[:-len(".md")]
        prefix, _, rest = stem.partition("-")
        out.append((rest if prefix.isdigit() and rest else stem, f.read_text(encoding="utf-8")))
    return out


def bundled_questions() -> list:
    """The demo's questions, one per non-empty line of kdn/data/questions.txt."""
    text = (_data() / "questions.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def bundled_sources() -> str:
    """kdn/data/SOURCES.md: where each bundled document comes from."""
    return (_data() / "SOURCES.md").read_text(encoding="utf-8")
