"""Text <-> token ids, and the model's own chat template.

Built on the `tokenizers` library from either a GGUF's metadata or a tokenizer.json;
`transformers` is never imported at run time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvfence.model.control_tokens import ChatTemplateError, ControlTokenText
from kvfence.model.tokenizer_json import objects

# Tokens that end a turn in common chat formats; like llama.cpp, treat them as
# end-of-generation even when the file names another token as EOS.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")

# GPT-2 style split used by llama.cpp's byte-level BPE pre-tokenizers.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
)


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""
    end_ids: frozenset[int] = field(default_factory=frozenset)


class KvTokenizer:
    """Encoding, decoding, end-of-generation ids and chat-template rendering for one model."""

    def __init__(self, info: TokenizerInfo):
        self.hf = info.tokenizer
        self.bos_id = info.bos_id
        self.eos_id = info.eos_id
        self.add_bos = info.add_bos
        self.chat_template = info.chat_template
        self.bos_token = info.bos_token
        self.eos_token = info.eos_token
        ends = set(info.end_ids)
        if info.eos_id is not None:
            ends.add(info.eos_id)
        for text in _END_OF_TURN:
            tid = self.hf.token_to_id(text)
            if tid is not None:
                ends.add(tid)
        self.end_ids = frozenset(ends)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.max_token_chars = _max_token_chars(self.hf)
        self.control = ControlTokenText(self.hf)   # a client's words spelling a control token stay words
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.StrictUndefined)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # A tokenizer.json post-processor may add BOS itself; a GGUF-built one has none.
        # encode_batch lets go of the GIL while it works, encode does not: a prompt of 600K
        # characters held every other thread (the event loop, the engine's Python) for 0.75 s
        ids = self.hf.encode_batch([text], add_special_tokens=add_special)[0].ids
        if add_special and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from its length alone (0 where none holds): a
        text far too long for the context is refused without seconds of tokenizing."""
        if not self.max_token_chars:
            return 0
        return -(-len(self.control.restored(text)) // self.max_token_chars)   # the text tokenized, markers spelled

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > 64:   # as encode: long ones without the GIL (the detokenizer's windows are short)
            return self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def template_has_tools(self) -> bool:
        """Does the model's chat template render OpenAI-style `tools` itself?"""
        return bool(self.chat_template) and "tools" in self.chat_template

    @property
    def template_has_developer(self) -> bool:
        """Does the chat template render OpenAI's "developer" role itself? (Most know only
        system, user, assistant and tool: there the developer message is the system message.)"""
        return bool(self.chat_template) and "developer" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        """The template's text for encode_rendered: the words of messages and tools that spell a
        control token stand there as markers (control_tokens.py), which it tokenizes as text."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send plain prompts instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError("each message needs a 'role' and a 'content'")
        try:
            messages, tools = self.control.mark(messages), self.control.mark(tools)
        except RecursionError:   # a tool's schema or a call's arguments nested deeper than Python's stack
            raise ChatTemplateError("the messages or tools are nested too deeply to render") from None
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         **({"tools": tools} if tools else {}))
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError) as e:   # a filter given what it cannot take: `|items` of a string
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list | None = None) -> list[int]:
        # The template writes its own special tokens; do not add a BOS twice.
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, tools))

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a rendered chat template (apply_chat_template's text: control tokens where
        the template wrote them, the messages' words as text even where they spell one)."""
        ids = self.control.encode(text)
        if self.add_bos and self.bos_id is not None and self.bos_token and not text.startswith(self.bos_token):
            ids = [self.bos_id] + ids
        return ids


# pre-tokenizers that keep every input character (Split keeps them unless its behavior is
# "removed"); Whitespace, WhitespaceSplit and BERT's drop whitespace
_KEEPING_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Split", "Metaspace", "Digits", "Punctuation"}


def _max_token_chars(hf: Tokenizer) -> int | None:
    """The most input characters one token can stand for, where that bounds the count: no
    normalizer (it may delete characters), pre-tokenizers that drop nothing, and a BPE that
    never fuses a run of unknown characters into one token. A vocabulary entry is its bytes
    (byte-level) or characters, and a character is at least one byte. None: no bound."""
    spec = json.loads(hf.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    kinds = {o["type"] for o in objects(pre) if isinstance(o.get("type"), str)}
    if (spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("fuse_unk")
            or not kinds <= _KEEPING_PRE_TOKENIZERS or "removed" in json.dumps(pre).lower()):
        return None
    # an added token that strips whitespace beside it stands for any run of it
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    # a BPE with no unknown token, no byte fallback and no byte-level step drops characters
    # it has no entry for
    if model.get("unk_token") is None and not model.get("byte_fallback") and "ByteLevel" not in kinds:
        return None
    return max((len(t) for t in hf.get_vocab(with_added_tokens=True)), default=0) or None


def _raise_template_error(message: str):
    raise ChatTemplateError(message)


def tokenizer_from_gguf_metadata(meta: dict) -> KvTokenizer:
    """Rebuild a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = _LLAMA3_SPLIT if pre in ("llama3", "llama-bpe") else _GPT2_SPLIT
    parts = []
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
        parts.append(pre_tokenizers.Digits(individual_digits=True))
    parts += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(parts)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole in the text.
    specials = [AddedToken(t, special=(ty == 3), normalized=False)
                for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens([a for a in specials if a.special])
    tok.add_tokens([a for a in specials if not a.special])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return KvTokenizer(TokenizerInfo(
        tokenizer=tok, bos_id=bos, eos_id=eos,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
        end_ids=frozenset(i for i in [meta.get("tokenizer.ggml.eot_token_id")] if i is not None),
    ))


def tokenizer_from_hf_folder(folder) -> KvTokenizer:
    """Load tokenizer.json plus what tokenizer_config.json says about BOS/EOS and chat."""
    from pathlib import Path

    folder = Path(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()   # a tokenizer.json may set truncation: a long prompt must reach I4 whole, not cut short
    tok.no_padding()      # or padding: pad ids would join the prompt
    cfg = {}
    if (folder / "tokenizer_config.json").exists():
        cfg = json.loads((folder / "tokenizer_config.json").read_text())

    def _text(v):
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    bos_token, eos_token = _text(cfg.get("bos_token")), _text(cfg.get("eos_token"))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    # tokenizer.json's post-processor adds BOS itself when the model wants one.
    return KvTokenizer(TokenizerInfo(
        tokenizer=tok,
        bos_id=tok.token_to_id(bos_token) if bos_token else None,
        eos_id=tok.token_to_id(eos_token) if eos_token else None,
        add_bos=False,
        chat_template=template,
        bos_token=bos_token, eos_token=eos_token,
    ))
