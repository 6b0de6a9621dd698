"""Long-context coherence prompts: a fact hidden deep in filler text, and a question about it.

The incident's tests checked status codes and speed at long context, never what the
answers said. These prompts make the answer checkable: the reply must contain the hidden
code. They are deterministic (seeded), so single-node and PD runs of the same prompt can
be compared token for token with the float32 single-node greedy output.

    from kvfence.bench.coherence import needle_prompt
    p = needle_prompt(tokenizer, target_tokens=3000, depth=0.3, seed=0)
    seq = engine.add_request(p.prompt_ids, p.params(max_tokens=24))
    ... run ...
    assert p.answered(seq.text)
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvfence.engine.params import SamplingParams

# Plain, varied sentences: the filler must read as ordinary text, not as a repeated loop
# the model latches onto.
_SUBJECTS = ["The river", "An old map", "The market square", "A quiet library", "The northern road",
             "The harbour", "A small orchard", "The railway station", "The village school", "A stone bridge",
             "The weather office", "A bakery on the corner", "The museum", "The lighthouse", "A mountain path"]
_VERBS = ["was busy on", "stayed calm through", "looked different during", "was repaired after",
          "drew many visitors on", "was described in a letter about", "was painted during",
          "was photographed on", "was mentioned in the news on", "was cleaned before"]
_TIMES = ["a cold Monday morning", "the long summer holidays", "the spring festival", "a rainy afternoon",
          "the first week of autumn", "a windy evening", "the harvest season", "a foggy dawn",
          "the last day of winter", "a bright Saturday"]
_TAILS = ["Nobody thought much of it.", "People still talk about that day.", "It was an ordinary scene.",
          "Children played nearby.", "A few birds circled overhead.", "The shops opened late.",
          "Someone wrote it down in a diary.", "The bells rang at noon.", "Tea was served at four.",
          "The streets were quiet."]


@dataclass(frozen=True)
class NeedlePrompt:
    messages: list[dict]        # chat messages (system-free: one user turn)
    prompt_ids: list[int]       # the chat template applied, ready for add_request
    code: str                   # what the answer must contain
    tenant_name: str
    fact: str
    fact_token_offset: int      # roughly where in prompt_ids the fact sits

    def answered(self, text: str) -> bool:
        """Does the reply say the code?"""
        return self.code in text.replace(",", "").replace(" ", "")

    @staticmethod
    def params(max_tokens: int = 24) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def filler(rng: random.Random, n_sentences: int) -> list[str]:
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TIMES)}. {rng.choice(_TAILS)}"
            for _ in range(n_sentences)]


def needle_prompt(tokenizer, target_tokens: int = 3000, depth: float = 0.3, seed: int = 0,
                  tenant_name: str | None = None, code: str | None = None) -> NeedlePrompt:
    """A chat prompt of about target_tokens tokens (within a page or so) with the sentence
    'The secret code for tenant X is NNNNN.' placed `depth` of the way into the filler, and
    a closing question asking for that code. `tokenizer` is a KvTokenizer (engine.tokenizer)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be between 0 and 1")
    rng = random.Random(seed)
    tenant_name = tenant_name or rng.choice(["Avalon", "Borealis", "Cobalt", "Dunmore", "Everest"])
    code = code or str(rng.randrange(10000, 99999))
    fact = f"The secret code for tenant {tenant_name} is {code}."
    question = f"What is the secret code for tenant {tenant_name}? Answer with the number only."

    def build(sentences: list[str]) -> tuple[list[dict], list[int], int]:
        at = int(round(depth * len(sentences)))
        body = sentences[:at] + [fact] + sentences[at:]
        text = ("Read the following notes carefully.\n\n" + " ".join(body) + "\n\n" + question)
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode_chat(messages)
        before = tokenizer.encode_chat([{"role": "user", "content": "Read the following notes carefully.\n\n"
                                         + " ".join(sentences[:at])}])
        return messages, ids, len(before)

    # sentences are ~12-16 tokens: estimate, then add or drop one at a time to land near the target
    sentences = filler(rng, max(1, target_tokens // 14))
    messages, ids, offset = build(sentences)
    for _ in range(400):
        if len(ids) < target_tokens - 16:
            sentences.append(filler(rng, 1)[0])
        elif len(ids) > target_tokens + 16 and len(sentences) > 1:
            sentences.pop()
        else:
            break
        messages, ids, offset = build(sentences)
    return NeedlePrompt(messages, ids, code, tenant_name, fact, offset)


# Short factual questions and a word the answer must contain. Each is one SmolLM2-135M-Instruct
# answers correctly in float32 greedy (checked with this model, chat template, 32 tokens); the
# ones it gets wrong in float32 (the capitals of Italy, Spain and the United States, the largest
# planet, a spider's legs) are left out: a bf16 path cannot be held to more than float32 knows.
# Before the LM head wrote float32 logits (#16), bf16 answered the first with "L'Étoile, ...".
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of England?", "London"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What color is the sky on a clear day?", "blue"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("Who painted the Mona Lisa?", "Leonardo"),
    ("What is the largest ocean on Earth?", "Pacific"),
]


def says(text: str, word: str) -> bool:
    """Does the answer contain the expected word (case aside)?"""
    return word.lower() in text.lower()
