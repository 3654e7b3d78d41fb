"""tiktoken rank files -> Hugging Face byte-level BPE files (``vocab.json``, ``merges.txt``,
``tokenizer.json``).

Each token's byte string is mapped through the GPT-2 byte-to-unicode table; its id is its rank.
Each multi-byte token's merge is recovered by running byte-level BPE over its bytes with only the
ranks below its own until two parts remain (a token for which that never happens has no merge,
which is how the official Qwen3.5 files leave 201 strings without a merge path); where the
lower ranks get stuck with more than two parts, BPE continues with every rank (30 Qwen3.5 merges
need this). Merges are listed in the rank order of the token they produce. The same procedure reproduces the official
Qwen3 ``vocab.json``/``merges.txt`` byte for byte and the official Qwen3.5 ``merges.txt`` too (checked against the recorded hashes).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def read_tiktoken(path: Path) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a ``.tiktoken`` file (``base64 rank`` per line)."""
    ranks = {}
    for line in Path(path).read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    parts = [token[i:i + 1] for i in range(len(token))]
    limit = rank
    while len(parts) > 2:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1])
            if pair_rank is not None and (limit is None or pair_rank < limit) and (best_rank is None or pair_rank < best_rank):
                best, best_rank = i, pair_rank
        if best is None:
            if limit is None:
                return None
            limit = None  # stuck below the token's rank: continue with every rank
            continue
        parts[best: best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and the ordered merge list equivalent to ``ranks``."""
    table = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            merge = _merge_of(token, rank, ranks)
            if merge is not None:
                merges.append((text(merge[0]), text(merge[1])))
    return vocab, merges


def vocab_json(vocab: dict[str, int], indent: int | None = None) -> str:
    """Qwen3's file is compact (``indent=None``); Qwen3.5's is indented by 4."""
    if indent is None:
        return json.dumps(vocab, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(vocab, ensure_ascii=False, indent=indent)


def merges_txt(merges: list[tuple[str, str]], header: bool = True) -> str:
    """Qwen3's file starts with ``#version: 0.2``; Qwen3.5's has no header line."""
    return ("#version: 0.2\n" if header else "") + "".join(f"{a} {b}\n" for a, b in merges)


def tokenizer_json(skeleton: dict, vocab: dict[str, int], merges: list[tuple[str, str]],
                   added_tokens: list[dict], pretokenize_regex: str) -> str:
    """A ``tokenizer.json`` from a same-family skeleton (normalizer, pre-tokenizer, decoder) with
    the given vocabulary, merges, added tokens and pre-tokenizer split regex."""
    data = json.loads(json.dumps(skeleton))
    data["added_tokens"] = added_tokens
    splits = [p for p in data["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    if len(splits) != 1:
        raise ValueError("skeleton pre-tokenizer must hold exactly one Split step")
    splits[0]["pattern"] = {"Regex": pretokenize_regex}
    data["model"]["vocab"] = vocab
    data["model"]["merges"] = [[a, b] for a, b in merges]
    return json.dumps(data, indent=2, ensure_ascii=False)
