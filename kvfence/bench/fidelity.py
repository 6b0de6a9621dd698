"""`kvfence bench --fidelity`: how closely each bf16 path follows float32, position by position.

The reference is kvfence in float32: it generates a greedy continuation for every prompt
(stopping at EOS or after `max_new` tokens), and at every position of prompt and continuation
keeps its top token and that token's logprob. Each contender is then teacher-forced through the
same tokens, and scored on the same positions:

- agreement: the share of positions whose argmax (torch's: the lowest id on a tie) is the
  float32 greedy token;
- mean |logprob difference| of that token against float32;
- exact ties: positions where the contender's two best logits are equal (bf16 logits tie often).

kvfence float32 is the reference rather than transformers float32 because it is what a user
compares kvfence's bf16 default with, and because it runs the same paged, chunked schedule;
transformers float32 is scored too, as a check that the two references agree (the parity tests
hold them within 1e-3 in logits). kvfence contenders run on a paged pool like the engine's:
prompts as chunked prefills (`chunk` tokens, so later chunks read cached pages), the continuation
one token a step, every sequence of a group in the same batch. transformers runs each whole
sequence in one forward pass.
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from kvfence.bench.coherence import filler
from kvfence.model.llama import AttentionRows, ForwardBatch, LlamaModel

CHAT = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three benefits of regular exercise?",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish and French.",
    "What is photosynthesis?",
    "List the planets of the solar system in order.",
    "How do I reverse a list in Python?",
]
PLAIN = [
    "Once upon a time, in a small village by the mountains,",
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "In 1969, the first humans landed on the Moon. The mission",
    "Water boils at 100 degrees Celsius at sea level because",
    "A good night's sleep is important for",
    "The recipe calls for two cups of flour,",
]
DOCUMENT = (
    "The city library opened its new reading room in the spring. It has tall windows facing the park, long "
    "oak tables and a quiet corner for children. Volunteers sorted more than ten thousand books donated by "
    "local families, and the librarians arranged them by subject: history, science, poetry, travel and "
    "cooking. On the first weekend, hundreds of visitors came to see the room. Some stayed for hours, reading "
    "by the windows; others borrowed a stack of books and promised to return the next week. The mayor gave "
    "a short speech thanking the volunteers, and a local band played in the courtyard. Since then the "
    "reading room has held a story hour every Saturday morning and a chess club on Thursday evenings. "
)


@dataclass
class Prompt:
    kind: str            # chat, plain, chat-long, plain-long
    ids: list[int]


def prompts(tokenizer, long_docs: int = 4, short: int | None = None) -> list[Prompt]:
    """Chat-templated and plain prompts, short (one or two pages) and multi-page (150-700 tokens).
    `short` limits the short prompts of each kind (the test's smaller set)."""
    import random

    out = [Prompt("chat", tokenizer.encode_chat([{"role": "user", "content": q}])) for q in CHAT[:short]]
    out += [Prompt("plain", tokenizer.encode(t)) for t in PLAIN[:short]]
    rng = random.Random(0)
    for i in range(long_docs):
        notes = " ".join(filler(rng, 6 + 14 * i))
        if i % 2 == 0:
            text = f"{DOCUMENT}\n\n{notes}\n\nSummarize the text above in a few sentences."
            out.append(Prompt("chat-long", tokenizer.encode_chat([{"role": "user", "content": text}])))
        else:
            out.append(Prompt("plain-long", tokenizer.encode(f"{DOCUMENT}{notes} The next day,")))
    return out


@dataclass
class Reference:
    """The float32 greedy sequences and, per position, the top token, its logprob, the top-2 margin."""
    tokens: list[list[int]]
    prompt_lens: list[int]
    top: list[torch.Tensor]        # [len] int64 per sequence
    logprob: list[torch.Tensor]    # [len] float32
    margin: list[torch.Tensor]     # [len] float32

    @property
    def positions(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def generated(self) -> int:
        return self.positions - sum(self.prompt_lens)


@dataclass
class Score:
    name: str
    positions: int
    agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    exact_ties: int
    seconds: float
    by_kind: dict = field(default_factory=dict)   # kind -> agreement


def _paged_run(model: LlamaModel, seqs: list[list[int]], prompt_lens: list[int], fused: bool, page_size: int,
               chunk: int, on_logits, extend=None, room: int = 0) -> None:
    """Feed every sequence through the model on a private paged pool: its first prompt_lens[i]
    tokens as prefill chunks of up to `chunk`, the rest one token a step, all in one batch.
    on_logits(i, first_position, logits [rows, vocab] float32) sees every position's logits.
    extend(i, logits_row) -> token or None: called after the sequence's last fed position; a token
    is appended to seqs[i] (greedy generation), up to `room` tokens past its given length."""
    cfg = model.config
    dev = model.device
    need = [-(-(len(s) + room) // page_size) for s in seqs]
    pages = [list(range(1 + sum(need[:i]), 1 + sum(need[:i + 1]))) for i in range(len(seqs))]
    width = max(need)
    slots = (1 + sum(need)) * page_size
    kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, slots, cfg.head_dim, dtype=model.dtype, device=dev)
    table = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, p in enumerate(pages):
        table[i, :len(p)] = torch.tensor(p)
    fed = [0] * len(seqs)
    while True:
        rows = []
        for i, s in enumerate(seqs):
            if fed[i] < len(s):
                n = min(chunk, prompt_lens[i] - fed[i]) if fed[i] < prompt_lens[i] else 1
                rows.append((i, fed[i], n))
        if not rows:
            return
        ids, pos, writes, q_start, q_len, kv_len = [], [], [], [], [], []
        for i, start, n in rows:
            q_start.append(len(ids))
            q_len.append(n)
            kv_len.append(start + n)
            for p in range(start, start + n):
                ids.append(seqs[i][p])
                pos.append(p)
                writes.append(pages[i][p // page_size] * page_size + p % page_size)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        idx = t([r[0] for r in rows])
        batch = ForwardBatch(t(ids), t(pos), t(writes),
                             AttentionRows(t(q_start), t(q_len), t(kv_len), table[idx].to(dev).contiguous()),
                             torch.arange(len(ids), device=dev), page_size)
        logits = model.forward(batch, kv, fused=fused)
        for (i, start, n), s0 in zip(rows, q_start):
            on_logits(i, start, logits[s0:s0 + n])
            fed[i] = start + n
            if extend is not None and fed[i] == len(seqs[i]) and fed[i] >= prompt_lens[i]:
                tok = extend(i, logits[s0 + n - 1])
                if tok is not None:
                    seqs[i].append(tok)


def reference(model: LlamaModel, ps: list[Prompt], max_new: int, end_ids, page_size: int = 16,
              chunk: int = 128, fused: bool = True) -> Reference:
    """Greedy float32 continuations (stop at an end id or after max_new) and per-position tops."""
    seqs = [list(p.ids) for p in ps]
    lens = [len(s) for s in seqs]
    top: list[list[torch.Tensor]] = [[] for _ in ps]
    lp: list[list[torch.Tensor]] = [[] for _ in ps]
    margin: list[list[torch.Tensor]] = [[] for _ in ps]

    def keep(i, _start, logits):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        two = torch.topk(logits.float(), 2, dim=-1).values
        best = torch.argmax(logits, dim=-1)
        top[i].append(best)
        lp[i].append(logprobs.gather(1, best[:, None])[:, 0])
        margin[i].append(two[:, 0] - two[:, 1])

    def extend(i, row):
        tok = int(torch.argmax(row))
        return None if tok in end_ids or len(seqs[i]) - lens[i] >= max_new else tok

    _paged_run(model, seqs, lens, fused, page_size, chunk, keep, extend, room=max_new + 1)
    # the last kept position predicted EOS (or the token past max_new): it stays a scored position
    cat = lambda parts: [torch.cat(x) for x in parts]  # noqa: E731
    return Reference(seqs, lens, cat(top), cat(lp), cat(margin))


class _Scorer:
    def __init__(self, ref: Reference):
        self.ref = ref
        self.hit = [torch.zeros(len(t), dtype=torch.bool) for t in ref.tokens]
        self.diff = [torch.zeros(len(t)) for t in ref.tokens]
        self.ties = 0

    def __call__(self, i: int, start: int, logits: torch.Tensor) -> None:
        logits = logits.float()
        n = logits.shape[0]
        top = self.ref.top[i][start:start + n]
        self.hit[i][start:start + n] = torch.argmax(logits, dim=-1) == top
        lp = torch.log_softmax(logits, dim=-1).gather(1, top[:, None])[:, 0]
        self.diff[i][start:start + n] = (lp - self.ref.logprob[i][start:start + n]).abs()
        two = torch.topk(logits, 2, dim=-1).values
        self.ties += int((two[:, 0] == two[:, 1]).sum())

    def score(self, name: str, seconds: float, kinds: list[str]) -> Score:
        hit, diff = torch.cat(self.hit), torch.cat(self.diff)
        by_kind: dict[str, list[int]] = {}
        for k, h in zip(kinds, self.hit):
            a = by_kind.setdefault(k, [0, 0])
            a[0] += int(h.sum())
            a[1] += len(h)
        return Score(name, len(hit), float(hit.float().mean()), float(diff.mean()), float(diff.max()), self.ties,
                     seconds, {k: round(a / n, 4) for k, (a, n) in by_kind.items()})


def score_kvfence(name: str, model: LlamaModel, ref: Reference, kinds: list[str], fused: bool,
                  page_size: int = 16, chunk: int = 128) -> Score:
    sc = _Scorer(ref)
    t0 = time.perf_counter()
    _paged_run(model, [list(s) for s in ref.tokens], ref.prompt_lens, fused, page_size, chunk, sc)
    return sc.score(name, time.perf_counter() - t0, kinds)


def score_transformers(name: str, hf, ref: Reference, kinds: list[str]) -> Score:
    sc = _Scorer(ref)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, s in enumerate(ref.tokens):
            sc(i, 0, hf(torch.tensor([s])).logits[0])
    return sc.score(name, time.perf_counter() - t0, kinds)


def load_transformers(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model


def run(fp32_model: LlamaModel, bf16_model: LlamaModel, tokenizer, hf_bf16=None, hf_fp32=None,
        max_new: int = 48, long_docs: int = 4, short: int | None = None, page_size: int = 16,
        chunk: int = 128, native_model: LlamaModel | None = None,
        other_matmul_model: LlamaModel | None = None) -> tuple[Reference, list[Score]]:
    """native_model: `--weights native` (the GGUF's blocks, int8 activations), scored against the
    same float32 reference: float32 of the same weights, dequantized. other_matmul_model: bf16
    with the layers on the matmul `--matmul auto` did not pick here (oneDNN's or kvfence's)."""
    ps = prompts(tokenizer, long_docs, short)
    kinds = [p.kind for p in ps]
    t0 = time.perf_counter()
    ref = reference(fp32_model, ps, max_new, tokenizer.end_ids, page_size, chunk)
    ref_s = time.perf_counter() - t0
    scores = [
        score_kvfence("kvfence bf16, fused kernels (default)", bf16_model, ref, kinds, True, page_size, chunk),
        score_kvfence("kvfence bf16, torch path (fused_kernels=False)", bf16_model, ref, kinds, False, page_size,
                      chunk),
    ]
    if other_matmul_model is not None:
        mm = other_matmul_model.matmul
        scores.append(score_kvfence(f"kvfence bf16, {mm} layers (--matmul {mm})", other_matmul_model, ref, kinds,
                                    True, page_size, chunk))
    if native_model is not None:
        scores.append(score_kvfence(f"kvfence native GGUF blocks ({native_formats(native_model)})", native_model,
                                    ref, kinds, True, page_size, chunk))
    if hf_bf16 is not None:
        scores.append(score_transformers("transformers bf16", hf_bf16, ref, kinds))
    if hf_fp32 is not None:
        scores.append(score_transformers("transformers float32 (check of the reference)", hf_fp32, ref, kinds))
    scores.append(Score("kvfence float32 (the reference)", ref.positions, 1.0, 0.0, 0.0,
                        int(sum(int((m == 0).sum()) for m in ref.margin)), ref_s))
    return ref, scores


def native_formats(model: LlamaModel) -> str:
    """The formats the native matmuls run, e.g. "Q4_1 layers, Q8_0 LM head"."""
    fmts = {getattr(m, "format", None) for layer in model.layers for m in (layer[1], layer[2], layer[4], layer[5])}
    layers = "/".join(sorted(f for f in fmts if f)) or "dequantized"
    return f"{layers} layers, {getattr(model.lm_head, 'format', 'bf16')} LM head"


def table(ref: Reference, scores: list[Score]) -> str:
    kinds = list(scores[0].by_kind)
    head = ("| contender | top-1 agreement | mean abs logprob diff | max | exact ties | "
            + " | ".join(kinds) + " |")
    lines = [head, "|" + "---|" * (5 + len(kinds))]
    for s in scores:
        lines.append(f"| {s.name} | {s.agreement:.4f} | {s.mean_abs_logprob_diff:.4f} | "
                     f"{s.max_abs_logprob_diff:.3f} | {s.exact_ties} | "
                     + " | ".join(f"{s.by_kind.get(k, 1.0):.4f}" for k in kinds) + " |")
    return "\n".join(lines)


def main(args) -> int:
    from kvfence.engine.config import EngineConfig
    from kvfence.engine.llm_engine import LoadedModel

    torch.set_num_threads(EngineConfig(num_threads=args.threads).threads())
    torch.set_flush_denormal(True)
    fp32 = LoadedModel.load(EngineConfig(model=args.model, dtype="float32", progress=False))
    bf16 = LoadedModel.load(EngineConfig(model=args.model, dtype="bfloat16", progress=False))
    other = LoadedModel.load(EngineConfig(model=args.model, dtype="bfloat16", progress=False,
                                          matmul="onednn" if bf16.model.matmul == "kvfence" else "kvfence"))
    other_model = other.model if other.model.layer_backends() != bf16.model.layer_backends() else None
    native = None
    if str(fp32.path).endswith(".gguf"):
        native = LoadedModel.load(EngineConfig(model=args.model, weights="native", progress=False)).model
    hf_bf16 = hf_fp32 = None
    if "transformers" in args.peers:
        try:
            hf_bf16 = load_transformers(fp32.path, torch.bfloat16)
            hf_fp32 = load_transformers(fp32.path, torch.float32)
        except ImportError as e:
            print(f"transformers skipped: {e} (install the test extras)")
    max_new = args.output_tokens or 48
    ref, scores = run(fp32.model, bf16.model, fp32.tokenizer, hf_bf16, hf_fp32, max_new=max_new,
                      page_size=args.page_size, native_model=native, other_matmul_model=other_model)
    gen = ref.generated
    print(f"{ref.positions} positions ({ref.positions - gen} prompt, {gen} generated by float32 greedy) over "
          f"{len(ref.tokens)} prompts; reference: kvfence float32; page size {args.page_size}")
    near = sum(int((m < 0.1).sum()) for m in ref.margin)
    print(f"positions whose float32 top-2 margin is below 0.1: {near}\n")
    print(table(ref, scores))
    if args.json:
        doc = {"positions": ref.positions, "generated": gen, "near_ties_below_0.1": near,
               "reference": "kvfence float32", "scores": [asdict(s) for s in scores]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(args.json, doc, "kvfence bench --fidelity")
    del hf_bf16, hf_fp32
    gc.collect()
    return 0
