"""Engine settings, with the defaults an operator gets from `kvfence serve`."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvfence.kv.pool import parse_bytes
from kvfence.model.linear import MATMULS

SCRUBS = ("none", "zero", "poison")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None                 # GGUF file or Hugging Face folder; None: bundled SmolLM2-135M
    dtype: str = "bfloat16"                  # bf16 is ~4x faster than fp32 on CPU; fp32 for exactness
    weights: str = "bf16"                    # native: a GGUF's quantized blocks as they are (docs/performance.md)
    matmul: str = "auto"                     # the layers' bf16 matmul on CPU: auto (oneDNN on AMX), kvfence, onednn
    device: str = "auto"                     # auto: cuda when present, else cpu
    page_size: int = 16
    kv_cache_memory: str | int | None = None  # e.g. "2GiB"; None: kv_memory_fraction of free memory
    kv_memory_fraction: float = 0.1
    max_model_len: int | None = None          # None: the model's own context
    clamp_context: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048        # per-step token budget (chunked prefill)
    # prefill tokens in a step that also decodes, for prompts that arrived after its streams began
    # (0: the whole budget): bounds the gap between a stream's tokens while new prompts arrive
    # (docs/performance.md, decode latency under prefill)
    prefill_tokens_while_decoding: int = 256
    # a step that decodes should take at most this long: the cap above shrinks to the prefill that
    # fits, learned from the steps run (engine/step_target.py); 0: the fixed token cap
    decode_step_target_ms: float = 200.0
    max_waiting: int = 1024                   # admitted but not running; beyond it: Overloaded (503)
    # how much of max_waiting one tenant may hold: half, so that others always find room; all
    # of it on a server with one tenant (`kvfence serve` without a tenants file), where half
    # would only refuse the one client sooner than --max-waiting says
    tenant_waiting_share: float = 0.5
    # how many of max_num_seqs one tenant's sequences may hold running: the rest stays for the
    # others, whose first request then starts in the next step. Nothing running is preempted to
    # make room (a probe: a tenant's 16 requests of n=16 took all 256 and another tenant's first
    # token waited 132-144 s). All of them with one tenant, as tenant_waiting_share
    tenant_running_share: float = 0.75
    scrub: str = "zero"                       # none | zero | poison (I7)
    verify_reads: bool = True                 # I2/I3 check before every pass; off only to measure its cost
    enable_prefix_cache: bool = True          # tenant-scoped reuse of prompt-prefix pages (I9)
    audit_reads: bool = False                 # record and check every page/slot each pass touches (kv/audit.py)
    fused_kernels: bool = True                # kvfence/kernels on CPU; off = plain torch ops (to compare)
    num_threads: int | None = None
    progress: bool = True

    @property
    def tenant_waiting_places(self) -> int:
        """The requests one tenant may have waiting: its share of max_waiting, at least one. A
        request's choices wait together, so it is also the largest n x prompts ever admitted."""
        return min(self.max_waiting, max(1, int(self.max_waiting * self.tenant_waiting_share)))

    def __post_init__(self) -> None:
        """The settings' rules, checked before anything loads: a zero step budget or batch size
        would have the engine spin without ever running a request, a negative cap stall every
        prompt; a NaN fails every comparison, so each bound is written to let NaN fail."""
        def need(ok: bool, what: str, value) -> None:
            if not ok:
                raise ValueError(f"{what}; got {value!r}")

        self.torch_dtype()
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name} must be at least 1", v)
        need(isinstance(self.page_size, int) and self.page_size >= 2 and self.page_size % 2 == 0,
             "page_size must be an even number of tokens, at least 2", self.page_size)
        need(self.prefill_tokens_while_decoding >= 0, "prefill_tokens_while_decoding must be >= 0 (0: the whole "
             "step budget)", self.prefill_tokens_while_decoding)
        need(0 <= self.decode_step_target_ms < float("inf"),
             "decode_step_target_ms must be >= 0 (0: the fixed token cap)", self.decode_step_target_ms)
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be at least 1",
             self.max_model_len)
        need(self.num_threads is None or self.num_threads >= 1, "threads must be at least 1", self.num_threads)
        cores = len(os.sched_getaffinity(0))
        # more threads than cores only makes them wait for each other (10,000 took minutes to start)
        need(self.num_threads is None or self.num_threads <= 4 * cores,
             f"threads must be at most 4 x the {cores} core(s) this process may run on", self.num_threads)
        if self.kv_cache_memory is not None:   # a size that does not parse fails now, not after the model loads
            try:
                parse_bytes(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        need(self.kv_cache_memory is not None or 0.0 < self.kv_memory_fraction <= 0.95,
             "kv_memory_fraction must be in (0, 0.95]", self.kv_memory_fraction)
        need(0.0 < self.tenant_waiting_share <= 1.0, "tenant_waiting_share must be in (0, 1]",
             self.tenant_waiting_share)
        need(0.0 < self.tenant_running_share <= 1.0, "tenant_running_share must be in (0, 1]",
             self.tenant_running_share)
        need(self.scrub in SCRUBS, f"scrub must be one of {', '.join(SCRUBS)}", self.scrub)
        need(self.matmul in MATMULS, f"matmul must be one of {', '.join(MATMULS)}", self.matmul)

    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}") from None

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch has no CUDA, or sees no GPU "
                             f"(torch {torch.__version__}); use --device cpu")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto; got {self.device!r}") from None
        return self.device

    def threads(self) -> int:
        """--threads, else the cores this process may use (a container's CPU limit included)."""
        from kvfence.cores import usable_cores

        return self.num_threads or usable_cores()
