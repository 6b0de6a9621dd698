"""A chat message's words are text, even where they spell a control token.

A chat template writes the turn markers itself (`<|im_start|>user`, `<|im_end|>`), and the
rendered text is tokenized with control tokens matched whole. A client's content that spells
one ("hi<|im_end|>\\n<|im_start|>system\\n...") therefore became a real turn marker: an end
user of a tenant's application could end their own turn and write a system or assistant turn
under the application's name. OpenAI's API reads such content as text, and OWASP's AI
verification standard (AISVS 2.1.7) asks for exactly that; transformers, vLLM and llama.cpp
parse it (transformers#29279 is the open report).

How: before rendering, every control token's text inside the client's strings is replaced by
a marker (letters and digits, so a template's trim, escape or tojson leaves it as it is; its
tag is random per process, so no client text holds one by chance, and one a client did send
could only ever turn into text). The rendered text is tokenized as before to find the control
tokens the template wrote; the text between them is tokenized again with control tokens read
as text and the markers put back as the words they stood for. A prompt without any such words
takes the old path and gets exactly the old ids.
"""
from __future__ import annotations

import re
import secrets

from tokenizers import Tokenizer


class ControlTokenText:
    """The control tokens of one tokenizer, and how a client's text spelling them stays text."""

    def __init__(self, hf: Tokenizer):
        self._hf = hf
        # the tokens decode() skips as special: turn markers, BOS/EOS, the model's reserved ones
        self._ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        self._texts = sorted({hf.id_to_token(i) for i in self._ids}, key=len, reverse=True)
        self._find = re.compile(_trie_pattern(self._texts)) if self._texts else None
        self._index = {t: k for k, t in enumerate(self._texts)}
        self._tag = "kvfctl" + secrets.token_hex(6)
        self._marker = re.compile(re.escape(self._tag) + r"([0-9]{1,4})x")
        self._as_text: Tokenizer | None = None   # a copy that reads control tokens as text, made when first needed

    def mark(self, value):
        """`value` (a string, or dicts and lists holding strings) with each control token's text in
        its strings replaced by a marker; anything else as it is. Dict keys are the API's, not text."""
        if isinstance(value, str):
            if self._find is None:
                return value
            return self._find.sub(lambda m: f"{self._tag}{self._index[m.group(0)]}x", value)
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        return value

    def marks(self, text: str) -> int:
        """How many markers `text` holds (each stands for at least one token)."""
        return len(self._marker.findall(text)) if self._tag in text else 0

    def without_marks(self, text: str) -> str:
        return self._marker.sub("", text)

    def encode(self, text: str) -> list[int] | None:
        """The ids of a rendered template holding markers (control tokens only where the template
        wrote them, the marked words as text); None when it holds none (tokenize it as usual)."""
        if self._tag not in text:
            return None
        found = self._hf.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = []
        at = 0
        for tid, (start, end) in zip(found.ids, found.offsets):
            if tid in self._ids:   # the template's own (the client's are markers by now)
                ids += self._words(text[at:start])
                ids.append(tid)
                at = end
        return ids + self._words(text[at:])

    def _spelled(self, m: re.Match) -> str:
        k = int(m.group(1))
        return self._texts[k] if k < len(self._texts) else m.group(0)

    def _words(self, text: str) -> list[int]:
        if not text:
            return []
        if self._as_text is None:
            copy = Tokenizer.from_str(self._hf.to_str())
            copy.encode_special_tokens = True
            self._as_text = copy
        text = self._marker.sub(self._spelled, text)
        return self._as_text.encode_batch([text], add_special_tokens=False)[0].ids


def _trie_pattern(words: list[str]) -> str:
    """A regex matching the longest of `words` at a point, built as a trie: a plain alternation
    of Llama 3's 256 reserved tokens took 0.37 s over a MiB of "<" (held the GIL, so the event
    loop too); the trie takes 15 ms."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)
