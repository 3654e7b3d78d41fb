"""Exact bytes of token ids, and incremental decoding that never splits a UTF-8 character.

Strict rows compare text the model has written with text the template renders, so the text of
a token stream must be exact and cheap to extend: :func:`token_bytes` maps every id to the bytes
it contributes (byte-level BPE vocabularies map through the GPT-2 byte alphabet; added tokens
such as ``<tool_call>`` contribute their literal content), and :class:`IncrementalText` turns
appended ids into text, holding back an incomplete multi-byte character until it completes.
"""

from __future__ import annotations

import codecs
import weakref
from typing import Sequence


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable-char stand-ins for the 256 byte values (char -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_TABLES: "weakref.WeakKeyDictionary[object, list[bytes]]" = weakref.WeakKeyDictionary()


def _hf(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _is_byte_level(hf) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each id contributes to decoded text (cached per tokenizer object)."""
    hf = _hf(tokenizer)
    table = _TABLES.get(hf)
    if table is not None:
        return table
    n = len(hf)
    pieces = hf.convert_ids_to_tokens(list(range(n)))
    added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
    if _is_byte_level(hf):
        # the alphabet's characters to their bytes, every other character below 256 dropped;
        # a piece holding a character above the alphabet is taken apart character by character
        alphabet = _byte_alphabet()
        to_bytes: dict[int, int | None] = dict.fromkeys(range(256))
        to_bytes.update((ord(c), b) for c, b in alphabet.items())
        table = []
        for i, piece in enumerate(pieces):
            if i in added:
                table.append(added[i].encode("utf-8"))
            elif piece is None:
                table.append(b"")
            else:
                try:
                    table.append(piece.translate(to_bytes).encode("latin-1"))
                except UnicodeEncodeError:
                    table.append(bytes(alphabet[c] for c in piece if c in alphabet))
    else:
        table = [hf.decode([i]).encode("utf-8") for i in range(n)]
    _TABLES[hf] = table
    return table


def ids_bytes(table: Sequence[bytes], ids: Sequence[int]) -> bytes:
    """The bytes of an id sequence."""
    return b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids)


class IncrementalText:
    """Text of an id stream, extended one batch of ids at a time (O(new ids))."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Sequence[int]) -> str:
        """Text that the new ids complete (an unfinished character is held back)."""
        return self._decoder.decode(ids_bytes(self._table, ids))
