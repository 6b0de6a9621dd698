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
could only ever turn into text or a 400). In the rendered text every control token's text is then the
template's own; the text between them is tokenized with control tokens read as text and the
markers put back as the words they stood for. A prompt without markers is tokenized as it
always was (exactly the old ids), checked where a normalizer could make other text match a
control token. Only the tokens decode() treats as special are protected: a model's ordinary
added tokens (Qwen's `<tool_call>`, `<think>`) are matched in text as before. A template that
changes a message's words (`| lower`) could still turn them into a control token's text after
marking; no known chat template does.
"""
from __future__ import annotations

import json
import re
import secrets

from tokenizers import Tokenizer

from kvfence.model.tokenizer_json import objects


class ChatTemplateError(ValueError):
    """Messages the model's chat template cannot write (the client's 400; tokenizer.py's too)."""


class ControlTokenText:
    """The control tokens of one tokenizer, and how a client's text spelling them stays text."""

    def __init__(self, hf: Tokenizer):
        self._hf = hf
        # the tokens decode() skips as special: turn markers, BOS/EOS, the model's reserved ones
        specials = {i: t for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._ids = frozenset(specials)
        self._id_of = {t.content: i for i, t in specials.items()}
        self._strips = {t.content: (t.lstrip, t.rstrip) for t in specials.values()}
        self._texts = sorted(self._id_of, key=len, reverse=True)
        self._index = {t: k for k, t in enumerate(self._texts)}
        self._find = re.compile(_trie_pattern(self._texts)) if self._texts else None
        # exact text is the only way to a control token unless a normalizer runs before matching it
        self._normalized = hf.normalizer is not None and any(t.normalized for t in specials.values())
        self._tag = "kvfctl" + secrets.token_hex(6)
        digits = len(str(max(1, len(self._texts))))   # a marker's number: an index into _texts
        self._marker = re.compile(re.escape(self._tag) + f"([0-9]{{1,{digits}}})x")
        self._as_text: tuple[Tokenizer, Tokenizer] | None = None   # made when first needed

    def mark(self, value):
        """`value` (a string, or dicts and lists holding strings) with each control token's text in
        its strings replaced by a marker; anything else as it is. Keys too: a tool's parameter
        names are keys, and a template may write them as they are (no API field name holds one)."""
        if isinstance(value, str):
            if self._find is None:
                return value
            return self._find.sub(lambda m: f"{self._tag}{self._index[m.group(0)]}x", value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        return value

    def restored(self, text: str) -> str:
        """`text` with its markers spelled out again: what is tokenized as text."""
        return self._marker.sub(self._spelled, text) if self._tag in text else text

    def encode(self, text: str) -> list[int]:
        """The ids of a rendered template holding markers or not: control tokens only where the
        template wrote them, every other character as text. ChatTemplateError where this
        tokenizer cannot write the client's words as text."""
        if self._tag not in text:
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
            if not self._normalized or self._controls(ids) == self._written(text):
                return ids
        return self._between_controls(text)

    def _written(self, text: str) -> list[int]:
        return [self._id_of[m.group(0)] for m in self._find.finditer(text)] if self._find else []

    def _controls(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i in self._ids]

    def _between_controls(self, text: str) -> list[int]:
        """Each of the template's control tokens by id, the text between them (markers spelled out)
        tokenized with control tokens read as text."""
        segments, controls, at = [], [], 0
        for m in self._find.finditer(text) if self._find else ():
            start, end = m.span()
            lstrip, rstrip = self._strips[m.group(0)]
            segments.append(text[at:start].rstrip(_SPACE) if lstrip else text[at:start])
            controls.append(self._id_of[m.group(0)])
            while rstrip and end < len(text) and text[end] in _SPACE:
                end += 1
            at = end
        segments.append(text[at:])
        segments = [self.restored(s) for s in segments]
        if any(self._tag in s for s in segments):   # a marker cut or a number no control token has
            raise ChatTemplateError("this model's chat template changes the text of messages, so a message that "
                                    "spells one of the model's control tokens cannot be written as text under it")
        first, later = self._copies()
        # a Metaspace pre-tokenizer that marks only the text's first word must not mark each segment's
        parts = first.encode_batch(segments[:1], add_special_tokens=False) + \
            later.encode_batch(segments[1:], add_special_tokens=False)
        ids = list(parts[0].ids)
        for tid, part in zip(controls, parts[1:]):
            ids.append(tid)
            ids += part.ids
        if self._controls(ids) != controls:   # the vocabulary spells a control token from plain text
            raise ChatTemplateError("a message spells one of the model's control tokens in a way this tokenizer "
                                    "cannot write as text")
        return ids

    def _spelled(self, m: re.Match) -> str:
        k = int(m.group(1))
        return self._texts[k] if k < len(self._texts) else m.group(0)

    def _copies(self) -> tuple[Tokenizer, Tokenizer]:
        """Two copies of the tokenizer that read control tokens as text: one for the text's start,
        one for text after a control token (never marked as a first word)."""
        if self._as_text is None:
            text = self._hf.to_str()
            spec = json.loads(text)
            first = Tokenizer.from_str(text)   # ~0.2 s for SmolLM2's, once per process
            later = first if not _never_first(spec.get("pre_tokenizer")) else Tokenizer.from_str(json.dumps(spec))
            for t in (first, later):
                t.encode_special_tokens = True
                t.no_padding()      # a tokenizer.json's padding would pad each piece to the longest
                t.no_truncation()
            self._as_text = (first, later)
        return self._as_text


# what the tokenizers library strips beside an lstrip/rstrip token: Unicode's White_Space
# (Rust's char::is_whitespace), which str.isspace widens by the separators U+001C..U+001F
_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
          "\u200a\u2028\u2029\u202f\u205f\u3000")


def _never_first(pre) -> bool:
    """Turn a Metaspace's "first" prefix scheme into "never"; whether there was one."""
    firsts = [o for o in objects(pre) if o.get("type") == "Metaspace" and o.get("prepend_scheme") == "first"]
    for o in firsts:
        o["prepend_scheme"] = "never"
    return bool(firsts)


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
