"""Documents the server answers from without prefilling them: states saved by `kvjax prefill --save`, named by
id, loaded once into the engine's byte-bounded LRU (pinned while requests read it) and continued by each
request's question, whose row reads the document's pages without copying them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import jax

from kvjax.cache.state import CacheCapacityError
from kvjax.engine.saved_state import SavedState, load_state, question_rows
from kvjax.engine.step import StepBackend
from kvjax.models.loading import Model
from kvjax.util.lru import BytesLRU

DOCUMENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a directory name under the documents folder


def _lru_key(document: str) -> tuple:
    return ("saved_document", document)


@dataclass
class DocumentStats:
    lookups: int = 0
    loads: int = 0  # documents read from disk (the rest were in memory)
    loaded_bytes: int = 0


class SavedDocuments:
    """Saved states under `directory/<document id>/`, loaded for `model` with the engine's `page_size` and
    page dtype, held in `lru` (the engine's `BytesLRU`, shared with its prefix states) by bytes, placed where
    `backend` (the engine's) keeps its states: on a mesh, each head shard's pages on its own pool."""

    def __init__(self, directory: str | os.PathLike, model: Model, lru: BytesLRU, page_size: int,
                 backend: StepBackend | None = None):
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"saved documents folder {os.fspath(directory)!r} does not exist")
        self.directory, self.model, self.lru, self.page_size = os.fspath(directory), model, lru, page_size
        self.backend = backend
        self.stats = DocumentStats()

    def get(self, document: str) -> SavedState:
        """The saved state of `document`, from memory or loaded now. FileNotFoundError for an unknown id,
        ValueError (`SavedStateError`) for a state this engine cannot continue."""
        if not DOCUMENT_ID.match(document or ""):
            raise ValueError(f"document id {document!r} must be a folder name (letters, digits, '.', '_', '-')")
        self.stats.lookups += 1
        key = _lru_key(document)
        saved = self.lru.get(key)
        if saved is None:
            path = os.path.join(self.directory, document)
            if not os.path.isdir(path):
                raise FileNotFoundError(f"no saved document {document!r} (no folder {path})")
            saved = load_state(path, self.model, page_size=self.page_size, page_dtype=self.model.cache_dtype,
                               backend=self.backend)
            size = sum(x.nbytes for x in jax.tree.leaves(saved.state))
            self.lru.put(key, saved, size)  # not kept when alone larger than the budget: then loaded again
            self.stats.loads += 1
            self.stats.loaded_bytes += size
        return saved

    def submit(self, engine, document: str, question_ids, max_new_tokens: int, **sampling) -> str:
        """Queue on `engine` (a `BatchEngine`) a request answering `question_ids` from `document`: the question
        fed by decode in the request's row, then decoded in a batch under the saved policy
        (`BatchEngine.submit_question`: rows on one document read its whole pages from one copy in their
        batch's pool; `sampling` its options). The document stays in the LRU (pinned) until the request
        finishes. Returns the request id; ValueError when the question and answer outgrow the document's room."""
        saved = self.get(document)
        try:
            question = question_rows(self.model, saved, list(question_ids), max_new_tokens)[0]
        except CacheCapacityError as error:
            raise ValueError(str(error)) from None
        key, lru = _lru_key(document), self.lru
        pinned = lru.pin(key)  # False when the document is larger than the LRU's budget (loaded each time)

        def unpin(request=None) -> None:
            if pinned:
                lru.unpin(key)

        try:
            return engine.submit_question(saved.state, saved.logits, question, max_new_tokens, saved.policy,
                                          document=(self.directory, document), on_finished=unpin, **sampling)
        except BaseException:
            unpin()
            raise


__all__ = ["DocumentStats", "SavedDocuments"]
