"""Offline API: `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields

from kvfence.engine.admission import ContextLengthExceeded
from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine, LoadedModel
from kvfence.engine.params import SamplingParams
from kvfence.engine.sequence import Sequence, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str            # stop | length | rejected | aborted
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ttft: float | None = None     # seconds from arrival to first token
    token_times: list[float] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the first prompt token (nothing comes before it),
    # then one per prompt token, as vLLM's RequestOutput.prompt_logprobs; None if not asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        prompt_lps = None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs]
        return cls(seq.request_id, seq.prompt, seq.prompt_ids, list(seq.output_ids), seq.text,
                   seq.finish_reason or "aborted", seq.error, list(seq.logprobs),
                   None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
                   list(seq.token_times), prompt_lps)


PromptLike = str | list[int]


class LLM:
    """A model on a paged KV pool with the ownership ledger, driven synchronously."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", loaded: LoadedModel | None = None,
                 **engine_args):
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_args) - names
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_args), loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptLike | Seq[PromptLike],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 tenant: str = "default") -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids). A prompt that does not
        fit comes back with finish_reason 'rejected' and an error naming the sizes; the
        others run normally."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist: list[SamplingParams] = (list(params) if isinstance(params, (list, tuple))
                                       else [params] * len(prompts))  # type: ignore[list-item]
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        results: list[RequestOutput | Sequence] = []
        for p, sp in zip(prompts, plist):
            text = p if isinstance(p, str) else None
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            results.append(self._submit(ids, sp, tenant, text))
        self._run()
        return [r if isinstance(r, RequestOutput) else RequestOutput.of(r) for r in results]

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             tenant: str = "default") -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs: list[list[dict]] = ([conversations] if conversations and isinstance(conversations[0], dict)
                                   else conversations)  # type: ignore[assignment]
        ids = [self.tokenizer.encode_chat(c) for c in convs]
        return self.generate(ids, params, tenant)

    def _submit(self, ids: list[int], sp: SamplingParams, tenant: str, text: str | None):
        try:
            return self.engine.add_request(ids, sp, tenant=tenant, prompt=text)
        except (ContextLengthExceeded, ValueError) as e:
            return RequestOutput("rejected", text, ids, [], "", "rejected", str(e))

    def _run(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
