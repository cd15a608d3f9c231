"""Generation benchmark (``make bench-generate``, ``graphopt bench --generate``): time to first token and time per new
token of causal language models, graphopt's ``generate()`` against transformers and optimum-intel, interleaved.

Models (`MODELS`): GPT-2 124M (GPT2Config's sizes), a small Llama (8 layers, 512 wide, 8 heads / 2 key-value heads,
intermediate 1408, vocabulary 32000) and a Qwen2 of the same sizes; random weights from their configs, the output
head untied from the input embeddings and sharpened (`sharpen_head`) so that greedy choices are clear rather than
near-ties. Batch 1, a 32-token prompt, 32 new tokens, greedy, ``min_new_tokens`` = ``max_new_tokens`` (no variant
stops early at the end-of-sequence token).

Each variant is built, then generates the new tokens once (its setup: compilers work then; its tokens are compared
with eager fp32's) and one first token (a warm-up). Per round, in a shuffled order (`graphopt.timing.round_order`),
each variant generates 1 token (time to first token: the prefill and one choice) then all the new tokens; time per
new token = (that time - the first token's) / (new tokens - 1). Ratios are eager fp32's time in the same round over
the variant's, median over the rounds (higher is faster). eager fp32 runs twice, as two variants: the second one's
ratio is the run's noise floor. A variant that cannot be built, or fails, is a row with the reason; the run goes on.
The results go to ``OUTPUT_DIR/bench.json`` and ``bench.md``, rewritten after each model, and the table is printed.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphopt
from graphopt.backends import DEFAULT_ENGINE, ENGINES
from graphopt.bench.generate_results import GenerationResult, ModelRows, VariantRow, write_outputs
from graphopt.bench.harness import machine_info
from graphopt.bench.results import FOREIGN_CPU_WARNING
from graphopt.bench.variants import VariantSkipped, select
from graphopt.errors import error_summary
from graphopt.quiet import TORCHAO_IMPORT_MESSAGES, log_messages_dropped
from graphopt.timing import ForeignLoad, round_order

MODELS = ("gpt2", "llama", "qwen2")
PROMPT_LENGTH, NEW_TOKENS = 32, 32
QUICK_NEW_TOKENS = 4  # --quick: a smoke run on tiny models
BOS, EOS = 1, 2  # every model's, so that prompts (ids from 3 up) never hold them
HEAD_SPREAD = 2.0  # the standard deviation of the log of the factor each output head row is multiplied by
TUNE_LOW_ACCURACY = 3e-2  # tune=True's budget that admits bf16 (graphopt.tuning.LOW_PRECISION_BOUNDS)
Generate = Callable[[int], torch.Tensor]  # new tokens -> their ids (batch 1)
# the clock every time is read from: a module attribute, so that tests replace it
clock: Callable[[], float] = time.perf_counter


def build_model(name: str, tiny: bool = False) -> nn.Module:
    """``name``'s causal language model with random weights (seeded), its head sharpened; with ``tiny``, 2 layers
    64 wide with a vocabulary of 100 (a smoke run that measures nothing)."""
    import transformers

    small = dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408, vocab_size=32000)
    tiny_sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    tokens = dict(bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    configs: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: transformers.GPT2Config(**tokens, **(dict(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=128) if tiny else {})),
        "llama": lambda: transformers.LlamaConfig(**tokens, **(tiny_sizes if tiny else small)),
        "qwen2": lambda: transformers.Qwen2Config(**tokens, **(tiny_sizes if tiny else small)),
    }
    torch.manual_seed(0)
    with log_messages_dropped(TORCHAO_IMPORT_MESSAGES):  # the model's module imports torchao, where it is installed
        model = transformers.AutoModelForCausalLM.from_config(configs[name]())
    return sharpen_head(model.eval())


def sharpen_head(model: nn.Module) -> nn.Module:
    """Multiply each row of ``model``'s output head by ``exp(HEAD_SPREAD * z)``, z standard normal (seed 0), in place.

    A random head gives every token a logit of the same distribution: the largest few lie close together, and a
    variant that only adds in another order can choose the runner-up. With rows of very different norms, as a trained
    model's frequent and rare tokens have, the greedy choice usually stands clear of the runner-up. (Scaling the whole
    head would change nothing: greedy choices are unchanged by a common factor, and so is the error relative to the
    logits.) The head must not share its weight with the input embeddings (``tie_word_embeddings=False``).
    """
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:
        raise ValueError("the output head shares its weight with the input embeddings: build the model with tie_word_embeddings=False")
    factors = torch.exp(HEAD_SPREAD * torch.randn(head.shape[0], 1, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        head.mul_(factors)
    return model


def prompt(vocabulary: int) -> dict[str, torch.Tensor]:
    """Batch 1, `PROMPT_LENGTH` token ids from 3 up (no special token), all attended."""
    ids = torch.randint(3, vocabulary, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@dataclass
class Setup:
    """What building a variant starts from: the model, the prompt, a folder for exported files, and notes a variant
    adds to its row (which engine and precision it runs in)."""

    model: nn.Module
    prompt: dict[str, torch.Tensor]
    workdir: Path
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Variant:
    """One way of generating: ``role`` is "baseline" (eager fp32), "peer" or "graphopt"."""

    key: str
    label: str
    role: str
    build: Callable[[Setup], Generate]


def greedy(generate: Callable[..., torch.Tensor], prompt: dict[str, torch.Tensor]) -> Generate:
    """``generate`` (transformers' or graphopt's) called greedily on ``prompt``, returning only the new tokens."""

    def new_tokens(count: int) -> torch.Tensor:
        with torch.inference_mode():
            sequences = generate(**prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=EOS)
        return sequences[0, prompt["input_ids"].shape[1] :]

    return new_tokens


def _eager(setup: Setup) -> Generate:
    return greedy(setup.model.generate, setup.prompt)


def _eager_bf16(setup: Setup) -> Generate:
    return greedy(copy.deepcopy(setup.model).to(torch.bfloat16).generate, setup.prompt)


def _static_cache_compiled(setup: Setup) -> Generate:
    """transformers' recipe: a static cache, so every decode step has the same shapes, and ``torch.compile`` on the
    forward. The setup's generation sizes the cache; the shorter first-token calls reuse it."""
    model = copy.deepcopy(setup.model)
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward)
    return greedy(model.generate, setup.prompt)


def _optimum_intel(precision: str) -> Callable[[Setup], Generate]:
    """optimum-intel's ``OVModelForCausalLM`` exported from the model saved with ``save_pretrained``, on as many
    threads as torch: ``f32`` and ``bf16`` set OpenVINO's inference precision (optimum-intel sets none by default, so
    OpenVINO takes bf16 on CPUs with native bf16, else f32); ``int8`` compresses the weights to 8 bits (NNCF) and
    leaves the precision to OpenVINO. The row notes the precision OpenVINO compiled for."""

    def build(setup: Setup) -> Generate:
        try:
            from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
        except ImportError as error:
            raise VariantSkipped(f"optimum-intel is not installed ({error_summary(error)}): make bench-generate installs it") from error
        saved = setup.workdir / "transformers-model"
        if not saved.exists():
            setup.model.save_pretrained(saved)
        ov_config = {"INFERENCE_NUM_THREADS": str(torch.get_num_threads())}
        if precision == "int8":
            options: dict[str, Any] = {"quantization_config": OVWeightQuantizationConfig(bits=8)}
        else:  # load_in_8bit=False: optimum-intel would compress the weights of a model over a billion parameters
            ov_config["INFERENCE_PRECISION_HINT"] = precision
            options = {"load_in_8bit": False}
        # the folder as a str: given a Path, optimum-intel's check for an already converted model calls str.replace on it
        model = OVModelForCausalLM.from_pretrained(str(saved), export=True, ov_config=ov_config, **options)
        computed = model.request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT")
        setup.notes.append(f"OpenVINO computes in {computed.get_type_name()}")
        return greedy(model.generate, setup.prompt)

    return build


def _graphopt(**options: Any) -> Callable[[Setup], Generate]:
    """``graphopt.optimize(model, prompt, remeasure=True, **options).generate``; the row notes the engine and precision
    it runs on (and what ``tune`` measured). Measured afresh: a decision remembered from an earlier run (tune's choice,
    a pass's timing) may be an earlier graphopt's, which this run would not measure."""

    def build(setup: Setup) -> Generate:
        optimized = graphopt.optimize(setup.model, setup.prompt, progress=False, remeasure=True, **options)
        report = optimized.graphopt_report
        assert report.generation is not None  # a causal language model with its cache gets generate()
        setup.notes.append(f"generate() on {report.generation.engine} ({report.generation.precision})")
        if report.tune is not None:
            setup.notes.append(f"tune: {report.tune.why}")
        return greedy(optimized.generate, setup.prompt)

    return build


def variants() -> list[Variant]:
    """Every variant, eager fp32 first; graphopt on each engine generation runs on besides the default, in each precision
    it generates in."""
    engines = [name for name, info in ENGINES.items() if info.generates and name != DEFAULT_ENGINE]
    return [
        Variant("eager", "transformers eager fp32", "baseline", _eager),
        Variant("eager-again", "transformers eager fp32 (again: the noise floor)", "peer", _eager),
        Variant("eager-bf16", "transformers eager bf16", "peer", _eager_bf16),
        Variant("compile-static", "transformers static cache + torch.compile", "peer", _static_cache_compiled),
        Variant("optimum-fp32", "optimum-intel OVModelForCausalLM f32", "peer", _optimum_intel("f32")),
        Variant("optimum-bf16", "optimum-intel OVModelForCausalLM bf16", "peer", _optimum_intel("bf16")),
        Variant("optimum-int8", "optimum-intel OVModelForCausalLM int8 weights", "peer", _optimum_intel("int8")),
        Variant("graphopt", "graphopt default", "graphopt", _graphopt()),
        Variant("graphopt-fuse", 'graphopt fuse="inductor"', "graphopt", _graphopt(fuse="inductor")),
        *[Variant(f"graphopt-{name}", f'graphopt engine="{name}"', "graphopt", _graphopt(engine=name)) for name in engines],
        *[
            Variant(f"graphopt-{name}-{precision}", f'graphopt engine="{name}", precision="{precision}"', "graphopt", _graphopt(engine=name, precision=precision))
            for name in engines
            for precision in ENGINES[name].generation_precisions
            if precision != "fp32"
        ],
        Variant("graphopt-tune", "graphopt tune=True", "graphopt", _graphopt(tune=True)),
        Variant("graphopt-tune-low", f"graphopt tune=True, accuracy={TUNE_LOW_ACCURACY:g}", "graphopt", _graphopt(tune=True, accuracy=TUNE_LOW_ACCURACY)),
    ]


def _prepare(variant: Variant, setup: Setup, row: VariantRow, new_tokens: int) -> tuple[Generate | None, torch.Tensor | None]:
    """Build ``variant``, generate ``new_tokens`` once and one token once; fill ``row``'s setup time, notes and
    status; return the generator and its tokens (None, None when it was skipped or failed)."""
    setup.notes = []
    started = clock()
    try:
        with warnings.catch_warnings():  # exporters' tracer warnings, transformers' deprecations
            warnings.simplefilter("ignore")
            generate = variant.build(setup)
            tokens = generate(new_tokens)
            row.setup_s = clock() - started
            generate(1)
    except VariantSkipped as reason:
        row.status, row.reason = "skipped", str(reason)
        return None, None
    except Exception as error:  # a failing variant is a result, not the end of the run
        row.status, row.reason = "failed", error_summary(error)
        return None, None
    finally:
        row.notes = list(setup.notes)
    return generate, tokens


def _time(generators: dict[str, Generate], rows: dict[str, VariantRow], rounds: int, new_tokens: int) -> float | None:
    """Interleaved rounds: each generator's first token, then all ``new_tokens``, into its row; a generator that
    fails is marked so and left out of later rounds. Returns the cores other processes kept busy meanwhile."""
    active = dict(generators)
    with ForeignLoad() as foreign:
        for index in range(rounds):
            for key in round_order(list(active), index):
                try:
                    started = clock()
                    active[key](1)
                    first = clock()
                    active[key](new_tokens)
                    finished = clock()
                except Exception as error:  # noqa: BLE001 - a call that fails is that variant's result
                    rows[key].status, rows[key].reason = "failed", f"while timed: {error_summary(error)}"
                    rows[key].first_token_ms, rows[key].per_token_ms = [], []
                    del active[key]
                    continue
                rows[key].first_token_ms.append((first - started) * 1e3)
                rows[key].per_token_ms.append(((finished - first) - (first - started)) * 1e3 / (new_tokens - 1))
    return foreign.cores


def same_tokens(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """The fraction of ``reference``'s tokens that ``tokens`` holds at the same positions (a shorter output misses
    the rest)."""
    shared = min(len(tokens), len(reference))
    return float((tokens[:shared] == reference[:shared]).sum()) / len(reference)


def measure_model(name: str, chosen: Sequence[Variant], rounds: int, new_tokens: int, tiny: bool, log: Callable[[str], None]) -> ModelRows:
    """Build, check and time every chosen variant on one model."""
    try:
        model = build_model(name, tiny)
    except Exception as error:  # noqa: BLE001 - a model that cannot be built is reported, the others run
        return ModelRows(name, 0, error=f"could not build it: {error_summary(error)}")
    result = ModelRows(name, sum(p.numel() for p in model.parameters()))
    generators: dict[str, Generate] = {}
    reference: torch.Tensor | None = None
    with tempfile.TemporaryDirectory(prefix="graphopt-bench-generate-") as workdir:
        setup = Setup(model, prompt(model.config.vocab_size), Path(workdir))
        for variant in chosen:
            row = VariantRow(variant.key, variant.label, variant.role)
            result.variants.append(row)
            if variant.role != "baseline" and reference is None:
                row.status, row.reason = "skipped", "eager fp32 did not run: nothing to compare with"
                continue
            generate, tokens = _prepare(variant, setup, row, new_tokens)
            if generate is not None and tokens is not None:
                reference = tokens if reference is None else reference
                row.same_tokens = same_tokens(tokens, reference)
                generators[variant.key] = generate
            status = f"set up in {row.setup_s:.1f} s" if row.status == "ok" else f"{row.status}: {row.reason}"
            log(f"{name}: {variant.label}: {status}")
        result.foreign_cpu = _time(generators, {row.key: row for row in result.variants}, rounds, new_tokens)
    if result.foreign_cpu is not None and result.foreign_cpu > FOREIGN_CPU_WARNING:
        result.warnings.append(f"other processes kept {result.foreign_cpu:.2f} cores busy on average while it was timed: rerun on a quiet machine")
    torch.compiler.reset()  # the next model starts with empty compile caches
    return result


def _versions() -> dict[str, str | None]:
    """The versions of the libraries the peers run on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in ("transformers", "openvino", "optimum-intel", "optimum", "nncf"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def run(
    models: Sequence[str],
    *,
    rounds: int = 5,
    new_tokens: int = NEW_TOKENS,
    patterns: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    tiny: bool = False,
    output_dir: Path = Path("bench-results/generate"),
    command: str = "graphopt bench --generate",
    log: Callable[[str], None] = print,
) -> GenerationResult:
    """Measure ``models`` (names from `MODELS`), writing the files after each; returns the result."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2: the time per new token is measured past the first")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}: --generate runs {', '.join(MODELS)}")
    chosen = select(variants(), patterns, exclude)  # type: ignore[arg-type] # select reads only .key and .role
    machine = {**machine_info(torch.device("cpu")), **_versions()}
    settings = {"rounds": rounds, "batch": 1, "prompt_length": PROMPT_LENGTH, "new_tokens": new_tokens, "tiny": tiny, "head_spread": HEAD_SPREAD}
    result = GenerationResult(command, machine, settings | {"variants": [variant.key for variant in chosen]})
    for name in models:
        log(f"graphopt bench --generate: {name}, {len(chosen)} variant(s), {rounds} interleaved round(s)")
        result.models.append(measure_model(name, chosen, rounds, new_tokens, tiny, log))
        for message in write_outputs(result, output_dir):
            log(message)
    return result
