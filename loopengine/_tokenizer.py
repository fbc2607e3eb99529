"""The ``cl100k_base`` tokenizer, built from the copy shipped inside the package.

tiktoken normally downloads its BPE ranks at first use; loopengine ships the
``cl100k_base`` ranks (``loopengine/data/cl100k_base.tiktoken``) so estimates
work with no network. The file is checked against the SHA-256 that tiktoken
itself expects for it, and the encoding is built with the pattern and special
tokens of tiktoken's own ``cl100k_base()`` constructor
(``tiktoken_ext/openai_public.py``), so counts equal tiktoken's.

The file is read once per process, on first use, and the encoding cached.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from pathlib import Path

import tiktoken

from loopengine._errors import LoopEngineError

__all__ = [
    "CL100K_PATTERN",
    "CL100K_SHA256",
    "CL100K_SPECIAL_TOKENS",
    "SHIPPED_CL100K",
    "cl100k",
    "load_cl100k",
]

SHIPPED_CL100K = Path(__file__).parent / "data" / "cl100k_base.tiktoken"
"""The shipped copy of tiktoken's ``cl100k_base.tiktoken``."""

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
"""The ``expected_hash`` tiktoken checks for ``cl100k_base.tiktoken``."""

# Copied from tiktoken_ext/openai_public.py:cl100k_base(); the constructor
# cannot be called for them because it downloads the ranks first.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
"""The pre-tokenizer pattern of ``cl100k_base``."""

CL100K_SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
"""The special tokens of ``cl100k_base``."""

_lock = threading.Lock()
_encoding: tiktoken.Encoding | None = None


def cl100k() -> tiktoken.Encoding:
    """The ``cl100k_base`` encoding from the shipped file, loaded on first use.

    Raises:
        LoopEngineError: the shipped file is missing or does not match its hash.
    """
    global _encoding
    if _encoding is None:
        # A lock, so that concurrent first uses read and verify the file once.
        with _lock:
            if _encoding is None:
                _encoding = load_cl100k(SHIPPED_CL100K)
    return _encoding


def load_cl100k(path: Path, expected_hash: str = CL100K_SHA256) -> tiktoken.Encoding:
    """Build the ``cl100k_base`` encoding from the ranks file at ``path``.

    The ranks are parsed as ``tiktoken.load.load_tiktoken_bpe(path,
    expected_hash=...)`` parses them, but without its cache: given a local
    path, that function writes a copy of the file into tiktoken's cache
    directory (and raises when a user-set cache directory is read-only), and
    an estimate must do no I/O beyond reading this one file.

    Args:
        path: A ``cl100k_base.tiktoken`` file.
        expected_hash: Its SHA-256, as hex.

    Raises:
        LoopEngineError: the file cannot be read, does not match
            ``expected_hash``, or is not a tiktoken ranks file.
    """
    try:
        data = path.read_bytes()
    except OSError as error:
        raise LoopEngineError(
            f"cannot read the tokenizer file {path}: {error}; reinstall loopengine"
        ) from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_hash:
        raise LoopEngineError(
            f"the tokenizer file {path} has SHA-256 {digest}, expected {expected_hash}: "
            "it is damaged or was replaced; reinstall loopengine"
        )
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as error:
            raise LoopEngineError(f"{path} is not a tiktoken ranks file: {line[:40]!r}") from error
    return tiktoken.Encoding(
        name="cl100k_base",
        pat_str=CL100K_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=dict(CL100K_SPECIAL_TOKENS),
    )
