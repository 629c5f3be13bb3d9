"""Real English prose available offline, and distinct filler windows of it in any tokenizer's tokens:
the haystacks and texts of the real-model tasks (`kvjax.tasks.needles`).

Notes: docs/modules.md (`kvjax/tasks/real_text.py`)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

COMMON_LICENSES_DIR = "/usr/share/common-licenses"
CORPUS_ENV = "KVJAX_CORPUS"  # a text file or a directory of .txt files used instead of the licence texts
TEXT_SUFFIXES = (".txt", ".text", ".md")
_RULE_LINE = re.compile(r"^\s*[-=_*~#]{3,}\s*$")
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
# a sentence ends at . ! ? (and closing quotes or brackets) before whitespace and a capital, digit, quote or
# bracket ("e.g. the" goes on); a paragraph break ends one too
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s+[\"'(\[A-Z0-9])|(?=\n\n)")


@dataclass(frozen=True)
class Document:
    """One cleaned text and where it came from (a path)."""

    name: str
    source: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents of English prose; `text` joins them with blank lines."""

    documents: tuple[Document, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(d.text for d in self.documents)

    @property
    def sources(self) -> list[str]:
        return [d.source for d in self.documents]

    @property
    def num_chars(self) -> int:
        return len(self.text)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class TokenizedCorpus:
    """A corpus in one tokenizer's ids (no special tokens) and the token indices where sentences start."""

    corpus: Corpus
    ids: np.ndarray  # int32 [num_tokens]
    sentence_starts: np.ndarray  # int64, ascending, 0 first
    tokenizer: object = field(repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)


@dataclass(frozen=True)
class Window:
    """`ids[start : start + length]` of a tokenized corpus; `sentence_starts` are offsets within the window."""

    start: int
    ids: np.ndarray  # int32 [length]
    sentence_starts: np.ndarray  # int64, ascending offsets in [0, length)

    @property
    def length(self) -> int:
        return int(self.ids.size)


# ---------------------------------------------------------------------------------------------- loading


def clean_text(text: str) -> str:
    """Cut Project Gutenberg's header and footer, rule lines and form feeds; join hard-wrapped lines into
    paragraphs (one per blank-line-separated block), with runs of spaces collapsed."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    lines = [("" if _RULE_LINE.match(line) else line) for line in text.replace("\r", "").replace("\f", "\n").split("\n")]
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(re.sub(r"[ \t]+", " ", p) for p in paragraphs)


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))} if words else set()


def dedupe_paragraphs(documents: Sequence[Document], threshold: float = 0.5) -> list[Document]:
    """Drop each paragraph whose word 5-grams are at least `threshold` already seen in earlier paragraphs
    (in document order), and documents left empty."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for doc in documents:
        kept = []
        for paragraph in doc.text.split("\n\n"):
            grams = _shingles(paragraph)
            if not grams or len(grams & seen) >= threshold * len(grams):
                continue
            seen |= grams
            kept.append(paragraph)
        if kept:
            out.append(Document(doc.name, doc.source, "\n\n".join(kept)))
    return out


def _version_key(name: str) -> tuple[str, float]:
    """'LGPL-2.1' -> ('LGPL', -2.1): a licence family together, its newest version first."""
    family, _, version = name.partition("-")
    try:
        return family, -float(version)
    except ValueError:
        return name, 0.0


def common_licenses_corpus(directory: str = COMMON_LICENSES_DIR) -> Corpus:
    """Debian's licence texts (see the module docstring), cleaned and de-duplicated."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"no real-text corpus: the default, Debian's licence texts, is not at {directory!r} (the base-files "
            f"package of Debian and Ubuntu puts it there). Name your own: a text file or a directory of .txt "
            f"files, as `--corpus DIR` (kvjax demo), {CORPUS_ENV}=DIR (any program) or path= (the Python API)"
        )
    names = sorted((n for n in os.listdir(directory) if not os.path.islink(os.path.join(directory, n))),
                   key=_version_key)
    documents = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                documents.append(Document(name, path, clean_text(f.read())))
    return Corpus(tuple(dedupe_paragraphs(documents)))


def text_files_corpus(path: str | os.PathLike) -> Corpus:
    """A text file, or every `.txt`/`.text`/`.md` file under a directory (sorted by path), cleaned and
    de-duplicated."""
    path = os.fspath(path)
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names
                       if n.lower().endswith(TEXT_SUFFIXES))
    else:
        raise FileNotFoundError(f"prose path {path!r} is neither a file nor a directory")
    documents = []
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            documents.append(Document(os.path.basename(file), file, clean_text(f.read())))
    documents = dedupe_paragraphs(documents)
    if not documents:
        raise ValueError(f"prose path {path!r} holds no text (looked for {', '.join(TEXT_SUFFIXES)} files)")
    return Corpus(tuple(documents))


def load_corpus(path: str | os.PathLike | None = None, min_chars: int = 0) -> Corpus:
    """The user's text at `path`, else at `$KVJAX_CORPUS`, else Debian's licence texts; raises when it holds
    under `min_chars`, or when none of them is there (naming the fix)."""
    if path is None and os.environ.get(CORPUS_ENV):
        path = os.environ[CORPUS_ENV]
        if not os.path.exists(path):
            raise FileNotFoundError(f"{CORPUS_ENV}={path!r} is neither a file nor a directory")
    corpus = text_files_corpus(path) if path is not None else common_licenses_corpus()
    if corpus.num_chars < min_chars:
        raise ValueError(
            f"the prose corpus ({', '.join(corpus.sources[:3])}{', ...' if len(corpus.sources) > 3 else ''}) "
            f"holds {corpus.num_chars} characters, fewer than min_chars={min_chars}; pass path= more text"
        )
    return corpus


def load_prose(min_chars: int = 0, path: str | os.PathLike | None = None) -> str:
    """`load_corpus(path, min_chars).text`: the documents joined by blank lines."""
    return load_corpus(path, min_chars).text


# ------------------------------------------------------------------------------------------- tokenizing


def split_sentences(text: str) -> list[str]:
    """Pieces of `text` that each hold one sentence with its leading whitespace; they join back to `text`."""
    pieces, last = [], 0
    for m in _SENTENCE_END.finditer(text):
        if m.end() > last:
            pieces.append(text[last : m.end()])
            last = m.end()
    if last < len(text):
        pieces.append(text[last:])
    return pieces


_TOKENIZED_CACHE: dict[tuple[int, str], TokenizedCorpus] = {}


def tokenize_corpus(tokenizer, corpus: Corpus | None = None) -> TokenizedCorpus:
    """`corpus` (default `load_corpus()`) in `tokenizer`'s ids, tokenized sentence by sentence without
    special tokens. The last few results are cached per (tokenizer, corpus)."""
    corpus = load_corpus() if corpus is None else corpus
    key = (id(tokenizer), corpus.fingerprint)
    cached = _TOKENIZED_CACHE.get(key)
    if cached is not None and cached.tokenizer is tokenizer:
        return cached
    pieces = split_sentences(corpus.text)
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    lengths = np.array([len(e) for e in encoded], np.int64)
    ids = np.fromiter((t for e in encoded for t in e), np.int32, int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    starts = np.unique(starts[lengths > 0])
    out = TokenizedCorpus(corpus, ids, starts, tokenizer)
    if len(_TOKENIZED_CACHE) >= 4:
        _TOKENIZED_CACHE.pop(next(iter(_TOKENIZED_CACHE)))
    _TOKENIZED_CACHE[key] = out  # the entry holds the tokenizer, so its id cannot be reused meanwhile
    return out


# ---------------------------------------------------------------------------------------------- windows


def _window(tc: TokenizedCorpus, start: int, length: int) -> Window:
    lo, hi = np.searchsorted(tc.sentence_starts, [start, start + length])
    return Window(int(start), tc.ids[start : start + length].copy(), tc.sentence_starts[lo:hi] - start)


def _disjoint_starts(tc: TokenizedCorpus, length: int, count: int, rng: np.random.Generator) -> list[int]:
    """`count` non-overlapping window starts, gaps drawn at random, each moved forward to a sentence start
    where the room to the next window allows."""
    n = tc.num_tokens
    slack = n - count * length
    cuts = np.sort(rng.integers(0, slack + 1, count))  # random composition of the slack into count+1 gaps
    starts, cursor = [], 0
    for i in range(count):
        desired = max(int(cuts[i]) + i * length, cursor)
        latest = n - (count - i) * length  # the windows after this one must still fit
        j = np.searchsorted(tc.sentence_starts, desired)
        if j < tc.sentence_starts.size and tc.sentence_starts[j] <= min(latest, desired + length // 4):
            desired = int(tc.sentence_starts[j])
        starts.append(desired)
        cursor = desired + length
    return starts


def windows(tokenizer, length: int, count: int, rng: np.random.Generator | int,
            corpus: Corpus | TokenizedCorpus | None = None, disjoint: bool | None = None) -> list[Window]:
    """`count` filler windows of exactly `length` tokens, in random order, no two with the same start.

    `disjoint=None` (default): non-overlapping when the corpus holds `count * length` tokens, else distinct
    sentence starts (or distinct token offsets) that may overlap; `True`: non-overlapping or an error;
    `False`: distinct sentence starts drawn at random. Raises `ValueError` when the corpus cannot supply
    `count` distinct windows of `length` tokens.
    """
    rng = np.random.default_rng(rng)
    if length < 1 or count < 0:
        raise ValueError(f"windows need length >= 1 and count >= 0, got length={length}, count={count}")
    tc = corpus if isinstance(corpus, TokenizedCorpus) else tokenize_corpus(tokenizer, corpus)
    n = tc.num_tokens
    where = f"the corpus ({n} tokens from {', '.join(tc.corpus.sources[:3])}{', ...' if len(tc.corpus.sources) > 3 else ''})"
    if count == 0:
        return []
    if count * length <= n and disjoint is not False:
        starts = _disjoint_starts(tc, length, count, rng)
    elif disjoint:
        raise ValueError(f"{where} cannot supply {count} non-overlapping windows of {length} tokens "
                         f"({count * length} tokens needed); pass more text or disjoint=None")
    else:
        sentence = tc.sentence_starts[tc.sentence_starts <= n - length]
        candidates = sentence if sentence.size >= count else np.arange(max(n - length + 1, 0))
        if candidates.size < count:
            raise ValueError(f"{where} cannot supply {count} distinct windows of {length} tokens "
                             f"(at most {candidates.size}); pass more text (path=) or ask fewer or shorter windows")
        starts = [int(s) for s in rng.choice(candidates, count, replace=False)]
    order = rng.permutation(count)
    return [_window(tc, starts[i], length) for i in order]
