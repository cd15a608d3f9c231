"""``graphopt bench --generate`` (graphopt.bench.generate): rows, ratios, same tokens, failures, the sharpened head.

The timing tests replace the benchmark's clock and its variants with stubs whose calls advance that clock by a
scripted amount per token, so times and ratios are checked exactly; the real run (tiny models, one round, a few
fast variants) is checked for form, never for speed.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

import transformers

from graphopt import cli
from graphopt.bench import generate
from graphopt.bench.generate import Setup, Variant

NEW_TOKENS = 4


class FakeClock:
    """Seconds that pass only when a stub generates (`stub`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stub(key: str, clock: FakeClock, prefill_s: float, token_s: float, role: str = "peer", wrong_from: int | None = None, fail_after: int | None = None) -> Variant:
    """A variant generating tokens 10, 11, ... (or 99 from position ``wrong_from``); its ``fail_after``-th call raises."""

    def build(setup: Setup) -> Callable[[int], torch.Tensor]:
        calls = 0
        setup.notes.append(f"stub {key}")

        def new_tokens(count: int) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if fail_after is not None and calls > fail_after:
                raise RuntimeError("the stub broke")
            clock.now += prefill_s + token_s * count
            tokens = torch.arange(10, 10 + count)
            if wrong_from is not None:
                tokens[wrong_from:] = 99
            return tokens

        return new_tokens

    return Variant(key, f"stub {key}", role, build)


def broken(setup: Setup) -> Callable[[int], torch.Tensor]:
    raise RuntimeError("could not build it")


def test_times_ratios_same_tokens_and_failures_fill_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(generate, "clock", clock)
    stubs = [
        stub("eager", clock, prefill_s=0.010, token_s=0.004, role="baseline"),
        stub("twice-as-fast", clock, prefill_s=0.005, token_s=0.002, wrong_from=2),
        stub("breaks-when-timed", clock, prefill_s=0.001, token_s=0.001, fail_after=3),
        Variant("unbuildable", "unbuildable", "graphopt", broken),
    ]
    monkeypatch.setattr(generate, "variants", lambda: stubs)
    result = generate.run(["gpt2"], rounds=3, new_tokens=NEW_TOKENS, tiny=True, output_dir=tmp_path, log=lambda line: None)

    (model,) = json.loads((tmp_path / "bench.json").read_text())["models"]
    rows = {row["key"]: row for row in model["variants"]}
    assert list(rows) == ["eager", "twice-as-fast", "breaks-when-timed", "unbuildable"]
    eager, fast = rows["eager"], rows["twice-as-fast"]
    assert eager["first_token_ms"] == pytest.approx([14.0] * 3) and eager["per_token_ms"] == pytest.approx([4.0] * 3)
    assert fast["first_token_ms"] == pytest.approx([7.0] * 3) and fast["per_token_ms"] == pytest.approx([2.0] * 3)
    assert eager["first_token_vs_eager"] == 1.0 and eager["same_tokens"] == 1.0
    assert fast["first_token_vs_eager"] == pytest.approx(2.0) and fast["per_token_vs_eager"] == pytest.approx(2.0)
    assert fast["same_tokens"] == 0.5 and fast["notes"] == ["stub twice-as-fast"]
    assert eager["setup_s"] == pytest.approx(0.010 + 0.004 * NEW_TOKENS)  # building it and generating the new tokens once
    timed_out = rows["breaks-when-timed"]
    assert timed_out["status"] == "failed" and timed_out["reason"] == "while timed: RuntimeError: the stub broke"
    assert timed_out["first_token_ms"] == timed_out["per_token_ms"] == [] and timed_out["per_token_vs_eager"] is None
    assert (rows["unbuildable"]["status"], rows["unbuildable"]["reason"]) == ("failed", "RuntimeError: could not build it")

    markdown = (tmp_path / "bench.md").read_text()
    assert markdown == result.to_markdown()
    assert "| gpt2 | stub twice-as-fast | 7.0 ms | 2.00x | 2.00 ms | 2.00x | 50% | " in markdown
    assert "| gpt2 | stub breaks-when-timed | — | — | — | — | 100% | " in markdown
    assert markdown.rstrip().endswith("| gpt2 | unbuildable | — | — | — | — | — | — | failed: RuntimeError: could not build it |")
    assert "per new token: (4-token generate() - first token) / 3" in markdown


def test_a_negative_time_per_token_has_no_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(generate, "clock", clock)
    stubs = [stub("eager", clock, prefill_s=0.010, token_s=0.004, role="baseline"), stub("noisy", clock, prefill_s=0.010, token_s=0.0)]
    monkeypatch.setattr(generate, "variants", lambda: stubs)
    (model,) = generate.run(["gpt2"], rounds=1, new_tokens=NEW_TOKENS, tiny=True, output_dir=tmp_path, log=lambda line: None).models
    noisy = model.variants[1]
    assert noisy.per_token_ms == [0.0] and model.ratio(noisy, "per_token_ms") is None
    assert model.ratio(noisy, "first_token_ms") == pytest.approx(14.0 / 10.0)


def test_a_quick_run_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # graphopt on OpenVINO: the default's decode compile would double this test's time (tests/test_generation_compile.py)
    variants = "eager-again,eager-bf16,optimum-fp32,graphopt-openvino"
    code = cli.main(["bench", "--generate", "--quick", "--models", "gpt2", "--variants", variants, "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["command"] == f"graphopt bench --generate --models gpt2 --rounds 1 --output-dir {tmp_path} --variants {variants} --quick"
    assert data["settings"]["new_tokens"] == generate.QUICK_NEW_TOKENS and data["settings"]["tiny"] is True
    assert data["machine"]["cpu"] and data["machine"]["optimum-intel"] == "2.2.0"  # make test installs it
    (model,) = data["models"]
    assert model["name"] == "gpt2" and model["error"] is None and model["parameters"] > 0
    rows = {row["key"]: row for row in model["variants"]}
    assert list(rows) == ["eager", "eager-again", "eager-bf16", "optimum-fp32", "graphopt-openvino"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert len(row["first_token_ms"]) == len(row["per_token_ms"]) == 1 and row["setup_s"] > 0
        assert row["first_token_vs_eager"] > 0 and 0 <= row["same_tokens"] <= 1
        noisy = min(row["per_token_ms"] + rows["eager"]["per_token_ms"]) <= 0  # possible with 4 tokens on a loaded machine
        assert (row["per_token_vs_eager"] is None) == noisy
    assert rows["eager-again"]["same_tokens"] == rows["optimum-fp32"]["same_tokens"] == rows["graphopt-openvino"]["same_tokens"] == 1.0
    assert rows["optimum-fp32"]["notes"] == ["OpenVINO computes in f32"]
    assert rows["graphopt-openvino"]["notes"] == ["generate() on openvino (fp32)"]
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.strip() in out
    assert markdown.startswith(f"Machine: {data['machine']['cpu']} (")
    assert "| model | variant | first token | vs eager fp32 | per new token | vs eager fp32 | same tokens | setup | note |" in markdown
    assert "| gpt2 | transformers eager fp32 | " in markdown and "| gpt2 | optimum-intel OVModelForCausalLM f32 | " in markdown


def test_without_optimum_intel_its_rows_say_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optimum.intel", None)  # import optimum.intel raises ImportError
    (model,) = generate.run(["gpt2"], rounds=1, new_tokens=2, patterns=["optimum-*"], tiny=True, output_dir=tmp_path, log=lambda line: None).models
    assert [row.key for row in model.variants] == ["eager", "optimum-fp32", "optimum-bf16", "optimum-int8"]
    for row in model.variants[1:]:
        assert row.status == "skipped" and row.reason is not None and row.reason.endswith(": make bench-generate installs it")
        assert row.first_token_ms == []
    assert model.variants[0].status == "ok" and len(model.variants[0].first_token_ms) == 1


def greedy_margins(model: nn.Module, steps: int = 16) -> list[float]:
    """Per greedy step: (best logit - runner-up) / the largest logit's magnitude."""
    with torch.inference_mode():
        out = model.generate(**generate.prompt(model.config.vocab_size), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=generate.EOS, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    margins = []
    for logits in out.logits:
        best, runner_up = logits[0].topk(2).values
        margins.append(float((best - runner_up) / logits[0].abs().max()))
    return margins


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sharpened_heads_make_greedy_choices_clear(kind: str) -> None:
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind](
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100,
        bos_token_id=generate.BOS, eos_token_id=generate.EOS, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).eval()
    sharpened = generate.sharpen_head(copy.deepcopy(plain))
    assert torch.equal(sharpened.get_input_embeddings().weight, plain.get_input_embeddings().weight)
    before, after = greedy_margins(plain), greedy_margins(sharpened)
    assert min(after) > 1e-2  # clear of bf16's rounding, about 4e-3 of the logits' scale
    assert statistics.median(after) > 5 * statistics.median(before)


def test_a_head_tied_to_the_input_embeddings_is_refused() -> None:
    tied = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64))
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        generate.sharpen_head(tied)


def test_options_of_other_benchmarks_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--generate", "--batch", "2", "--device", "cpu"]) == 2
    assert "--batch, --device: not options of --generate" in capsys.readouterr().err
    assert cli.main(["bench", "--generate", "--models", "gpt3"]) == 2
    assert "unknown model(s) gpt3: --generate runs gpt2, llama, qwen2" in capsys.readouterr().err


def test_same_tokens_counts_equal_positions_of_the_reference() -> None:
    reference = torch.tensor([5, 6, 7, 8])
    assert generate.same_tokens(torch.tensor([5, 0, 7, 8]), reference) == 0.75
    assert generate.same_tokens(torch.tensor([5, 6]), reference) == 0.5  # stopped early: the missing tokens differ


def test_each_engine_generation_runs_on_is_a_variant_in_each_precision_it_generates_in() -> None:
    keys = [variant.key for variant in generate.variants()]
    assert keys[:2] == ["eager", "eager-again"] and len(set(keys)) == len(keys)
    assert {"graphopt", "graphopt-fuse", "graphopt-openvino", "graphopt-openvino-int8", "graphopt-openvino-bf16", "graphopt-tune", "graphopt-tune-low"} <= set(keys)
