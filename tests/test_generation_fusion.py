"""optimize(fuse=...) of a causal language model: the decode graph's pointwise regions are compiled (the prefill keeps
its ops), the report says so, and generate() gives the original's tokens at another batch size and prompt length.
A tiny Llama (tests.test_generation's, one layer). fuse="graph" and the default compile the whole decode graph:
tests/test_generation_compile.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

import graphopt
from graphopt.backends.fuse_compile import FusedRegion
from tests.test_generation import original_generate, prompt, tiny


def regions(graph: torch.fx.GraphModule) -> list[torch.nn.Module]:
    return [graph.get_submodule(str(node.target)) for node in graph.graph.nodes if node.op == "call_module" and "pointwise_region" in str(node.target)]


def test_fuse_compiles_the_decode_graphs_pointwise_regions_and_generates_the_originals_tokens() -> None:
    model = tiny("llama", num_hidden_layers=1)  # one layer has every kind of region; each layer more adds compiles, not cases
    ids, mask = prompt(2, 6, padded=2)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, fuse="inductor")
    steps, report = fast.generator.steps, fast.graphopt_report.generation
    fused = regions(steps.decode)
    assert fused and all(isinstance(region, FusedRegion) for region in fused)  # RMSNorm, rotary embedding, SiLU x up
    assert regions(steps.prefill) == []
    assert any(line.startswith(f"decode: fusion (inductor): {len(fused)}/{len(fused)} regions compiled") for line in report.passes)
    assert "decode: extract_pointwise_regions" in " ".join(report.passes) and "prefill: extract_pointwise_regions" not in " ".join(report.passes)
    other_ids, other_mask = prompt(3, 9, padded=4, seed=7)
    assert torch.equal(fast.generate(other_ids, other_mask, max_new_tokens=6), original_generate(model, other_ids, other_mask, max_new_tokens=6))
