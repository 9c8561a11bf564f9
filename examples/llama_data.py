"""Real documents as byte tokens, shuffled and packed into fixed-size chunks (no download).

The default corpus is the Python standard library of the running interpreter: several hundred real
source files from about 100 bytes to 750 KB, a heavy-tailed length mix like real code corpora. A
folder of text files or a JSONL file with a ``text`` field can stand in for it.

Tokens are bytes (vocabulary 256). Documents are shuffled with a seed and laid end to end into one
stream, which is cut into chunks of ``context`` tokens; a document that crosses a chunk boundary is
cut there and its rest opens the next chunk as a separate document (positions restart, attention
does not reach back). When the stream runs out, the next epoch continues with a new shuffle.
Chunk ``i`` is a pure function of ``(documents, seed, context, i)``, so a resumed run sees exactly
the data it would have seen.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
# Test suites of the standard library hold deliberately broken files (bad encodings, syntax
# errors) and would dominate the corpus; the library's own source is what we want.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_MIN_BYTES = 100  # empty ``__init__.py`` files and one-line stubs carry nothing to learn


@dataclass
class Corpus:
    """Documents as byte arrays.

    Attributes:
        source: where they came from (a path), for the run's metrics.
        documents: one uint8 array per document, in a fixed (sorted-path or file) order.
    """

    source: str
    documents: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return int(sum(len(d) for d in self.documents))


def stdlib_dir() -> Path:
    """The running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _folder_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted walk so the corpus order (and therefore every shuffle) is the same on every run.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if suffixes is None or name.endswith(suffixes):
                found.append(Path(dirpath) / name)
    return found


def source_problem(path: str | os.PathLike | None) -> str | None:
    """What makes ``path`` unusable as :func:`load_corpus`'s source, seen without reading it (so a
    run can refuse it before anything starts): ``"no such file or folder"`` or ``"not a folder or
    a .jsonl file"``; None when it may be loaded (None: the standard library)."""
    if path is None:
        return None
    root = Path(path)
    if root.is_dir() or (root.is_file() and root.suffix == ".jsonl"):
        return None
    return "not a folder or a .jsonl file" if root.exists() else "no such file or folder"


def load_corpus(path: str | os.PathLike | None = None, *, min_bytes: int = _MIN_BYTES) -> Corpus:
    """Load documents as bytes.

    Args:
        path: None for the standard library's ``*.py`` files; a folder (every file in it,
            recursively, except hidden ones and test folders); or a ``.jsonl`` file whose lines are
            objects with a ``text`` field (encoded as UTF-8).
        min_bytes: documents shorter than this are left out.

    Raises:
        ValueError: the path does not exist, or nothing usable was found there.
    """
    if path is None:
        root, files = stdlib_dir(), _folder_files(stdlib_dir(), (".py",))
        docs = [np.frombuffer(f.read_bytes(), dtype=np.uint8) for f in files]
        source = str(root)
    else:
        root = Path(path)
        if root.is_dir():
            docs = [np.frombuffer(f.read_bytes(), dtype=np.uint8) for f in _folder_files(root, None)]
        elif root.is_file() and root.suffix == ".jsonl":
            docs = []
            with root.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{root}:{lineno}: not a JSON object with a 'text' field") from None
                    docs.append(np.frombuffer(str(text).encode("utf-8"), dtype=np.uint8))
        else:
            raise ValueError(f"--data {path}: {source_problem(path)}")
        source = str(root.resolve())
    docs = [d for d in docs if len(d) >= min_bytes]
    if not docs:
        raise ValueError(f"no documents of at least {min_bytes} bytes under {source}")
    return Corpus(source, docs)


class PackedStream:
    """Shuffled documents packed into chunks of ``context`` tokens.

    Args:
        corpus: the documents.
        context: tokens per chunk (one chunk per data-parallel rank and step).
        seed: shuffle seed; epoch ``e`` uses the permutation drawn from ``(seed, e)``.
    """

    def __init__(self, corpus: Corpus, context: int, seed: int):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.corpus, self.context, self.seed = corpus, context, seed
        self.lengths = np.array([len(d) for d in corpus.documents], dtype=np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s document order and the stream offset where each of them starts."""
        if epoch not in self._orders:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            starts = np.concatenate([[0], np.cumsum(self.lengths[order])[:-1]])
            self._orders[epoch] = (order, starts)
        return self._orders[epoch]

    def _span(self, start: int, stop: int) -> tuple[list[np.ndarray], list[int]]:
        """Pieces of documents covering stream tokens ``[start, stop)`` (may cross epochs)."""
        pieces: list[np.ndarray] = []
        while start < stop:
            epoch, offset = divmod(start, self.epoch_tokens)
            end = min(stop - start, self.epoch_tokens - offset) + offset  # stay inside this epoch
            order, starts = self._order(epoch)
            i = int(np.searchsorted(starts, offset, side="right")) - 1
            while offset < end:
                doc = self.corpus.documents[order[i]]
                a = offset - int(starts[i])
                b = min(len(doc), end - int(starts[i]))
                pieces.append(doc[a:b])
                offset += b - a
                i += 1
            start += end - (start % self.epoch_tokens)
        return pieces, [len(p) for p in pieces]

    def chunk(self, index: int) -> tuple[np.ndarray, list[int]]:
        """Chunk ``index``: ``(tokens uint8 [context], doc_lens)`` with ``sum(doc_lens) == context``.

        The first piece may be the continuation of a document cut at the end of chunk ``index-1``;
        the last piece may be cut and continue in chunk ``index+1``.
        """
        pieces, lens = self._span(index * self.context, (index + 1) * self.context)
        return np.concatenate(pieces), lens

    def batch(self, step: int, world_size: int) -> list[tuple[np.ndarray, list[int]]]:
        """The chunks of training step ``step``: rank ``r`` gets chunk ``step * world_size + r``."""
        return [self.chunk(step * world_size + r) for r in range(world_size)]


def collate(tokens: np.ndarray, doc_lens: list[int]) -> dict:
    """One rank's packed chunk as transformers' ``DataCollatorWithFlattening`` makes it.

    Args:
        tokens: uint8 [sum(doc_lens)], the chunk (``PackedStream.chunk``).
        doc_lens: its document lengths, in packing order.

    Returns:
        ``input_ids``, ``labels`` (-100 at each document's first token, so no prediction crosses a
        document boundary) and ``position_ids`` (restarting at 0 in every document), all int64
        [1, sum(doc_lens)]; ``cu_seq_lens_q/k`` int32 [len(doc_lens) + 1]; ``max_length_q/k``. The
        ``cu_seq_lens`` say "one document" when a chunk is a single document, which
        ``position_ids`` alone cannot (distca refuses such a training row).
    """
    from transformers import DataCollatorWithFlattening
    docs = np.split(tokens.astype(np.int64), np.cumsum(doc_lens)[:-1])
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
