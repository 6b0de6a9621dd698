"""Long-context coherence across prefill and decode: a fact 30% of the way into a
~3,000-token prompt is retrieved the same way by a real PD cluster (three processes,
~190 pages of KV moved by Mooncake) as by the float32 single node, and the answer says it."""
from __future__ import annotations

import openai
import pytest
from pd_cluster import NODE_ARGS, Cluster

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")


def _args(**over) -> list[str]:
    args = list(NODE_ARGS)
    for flag, value in over.items():
        i = args.index(flag)
        args[i + 1] = value
    return args


@pytest.fixture(scope="module")
def big_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pd-long"),
                node_args=_args(**{"--dtype": "float32", "--kv-cache-memory": "160MiB", "--max-model-len": "3200",
                                   "--max-num-batched-tokens": "1024", "--lease": "30", "--max-pull": "10"}))
    c.start_all()
    yield c
    c.stop()


def test_pd_long_context_answer_says_the_fact_like_single_node(big_cluster, long_needle, long_needle_fp32_answer):
    needle, single = long_needle, long_needle_fp32_answer    # tests/conftest.py
    assert needle.answered(single.text), single.text

    client = openai.OpenAI(base_url=big_cluster.url("router") + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=needle.prompt_ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == single.text          # what the answer says, token for token
    assert needle.answered(r.choices[0].text)
    pd = big_cluster.pd("decode")
    assert pd["pd_verified"] == 1 and pd["transferred_bytes"] >= (len(needle.prompt_ids) // 16) * 737_280
