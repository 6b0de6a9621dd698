"""The model-loading progress bar is for a terminal: in a log file (stderr not a TTY) its
carriage returns glued the next log line onto it (found by an operator walkthrough)."""
from __future__ import annotations

import io

import torch

from kvfence.model import weights as weights_module
from kvfence.model.config import ModelConfig

CFG = ModelConfig(name="t", vocab_size=4, hidden_size=2, intermediate_size=2, num_layers=3, num_heads=1,
                  num_kv_heads=1, head_dim=2, rope_theta=1e4, rms_norm_eps=1e-5, max_context=8, tie_embeddings=True)


def _assemble():
    return weights_module.assemble(CFG, lambda field, layer: torch.zeros(1), "loading t", progress=True)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_in_a_log_file_and_one_on_a_terminal(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(weights_module.sys, "stderr", log)
    assert len(_assemble().layers) == 3
    assert log.getvalue() == ""
    term = _Terminal()
    monkeypatch.setattr(weights_module.sys, "stderr", term)
    _assemble()
    assert "loading t" in term.getvalue() and "\r" in term.getvalue()
