"""Byte-level tokenizer shipped with the reference engine.

Token ids 0..255 are the raw bytes; then three specials: BOS=256, EOS=257, PAD=258.
``VOCAB_SIZE`` = 259. Decoding never fails: invalid or partial UTF-8 becomes U+FFFD,
specials are skipped (or rendered as ``<|bos|>`` etc. when asked).
"""

from __future__ import annotations

from collections.abc import Iterable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
SPECIAL_NAMES = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>"}


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS/EOS/PAD."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for t in ids:
            t = int(t)
            if 0 <= t < 256:
                out.append(t)
            elif not skip_special_tokens and t in SPECIAL_NAMES:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(SPECIAL_NAMES[t])
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    @staticmethod
    def complete_prefix_len(ids: list[int]) -> int:
        """Length of the longest prefix of ``ids`` not ending inside a UTF-8 character."""
        n = len(ids)
        for back in range(1, min(4, n) + 1):
            b = int(ids[n - back])
            if not 0 <= b < 256 or b < 0x80 or b >= 0xF8:
                return n  # special, ASCII or invalid byte: nothing pending
            if b >= 0xC0:  # lead byte: is its sequence complete?
                need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
                return n if back >= need else n - back
        return n

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (what SGLang puts in logprob triples)."""
        t = int(token_id)
        if t in SPECIAL_NAMES:
            return SPECIAL_NAMES[t]
        return bytes([t]).decode("utf-8", errors="replace") if 0 <= t < 256 else ""
