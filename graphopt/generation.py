"""Language models: ``OptimizedModule.generate()`` with the key/value cache, on graphs captured by torch.export.

A causal language model (a transformers ``GenerationMixin`` whose ``config.use_cache`` is on) is
captured as two graphs (`capture_steps`):

- prefill: the prompt (``input_ids``, ``attention_mask``, ``position_ids``, any length) -> the last
  position's logits and each layer's keys and values;
- decode: one token, the mask and position so far and the cache -> the logits and the cache one
  token longer.

The cache is explicit: tensors in, tensors out, so any runtime that runs a graph can run it.
`Generator.generate` runs transformers' own loop on them: the same logits processors
(``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``), the same sampling
(``torch.multinomial`` on the global generator: ``torch.manual_seed`` gives the original's tokens),
the same end of sequences (``eos_token_id``, ``pad_token_id``) and the same positions for
left-padded batches. `graphopt.generation_build` builds it on an engine and verifies it against
the original's own ``generate()``.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.backends import EngineInfo
from graphopt.errors import CaptureError, InputMismatchError, InvalidInputsError, InvalidModelError, InvalidOptionError
from graphopt.report import GenerationReport

# the options of transformers' generate() that Generator.generate takes; num_beams only as 1 (greedy or sampling)
OPTIONS = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "num_beams")
# generation_config fields that change what generate() computes, at the values that leave it unchanged
_NEUTRAL = {
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_p": (None,), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,), "encoder_repetition_penalty": (None, 1.0),
    "renormalize_logits": (None, False), "guidance_scale": (None, 1.0), "num_return_sequences": (None, 1), "length_penalty": (None, 1.0),
    "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1), "penalty_alpha": (None,), "watermarking_config": (None,),
    "exponential_decay_length_penalty": (None,), "assistant_model": (None,), "prompt_lookup_num_tokens": (None,), "stop_strings": (None,),
    "max_time": (None,), "low_memory": (None, False), "output_scores": (None, False), "output_logits": (None, False),
    "return_dict_in_generate": (None, False),
}  # fmt: skip
# transformers' own defaults for what generate() reads when neither the call nor the model's generation_config sets it
_DEFAULTS = {"max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "num_beams": 1}
MAX_BATCH = 1024  # the largest batch the graphs take
# the clock the report's prefill and per-token times are read from: a module attribute, so that tests replace it
clock: Callable[[], float] = time.perf_counter


def is_cached_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal language model that generates with its key/value cache."""
    try:
        from transformers import GenerationMixin
    except ImportError:
        return False
    config = getattr(model, "config", None)
    return isinstance(model, GenerationMixin) and bool(getattr(config, "use_cache", False)) and not getattr(config, "is_encoder_decoder", False)


def check_model(model: nn.Module, training: bool) -> None:
    """Refuse what generation with graphopt cannot do: training, and a cache other than one key and value tensor per layer."""
    if training:
        raise InvalidOptionError(
            f"{type(model).__name__} generates with its key/value cache, which is for inference: call model.eval() "
            "(or pass mode='inference'); to optimize a training step, set model.config.use_cache = False first"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "sliding_window", None) is not None and (not layer_types or layer_types - {"full_attention"}):
        raise InvalidModelError(
            f"{type(model).__name__} uses sliding-window attention (sliding_window={config.sliding_window}): its cache keeps a window "
            "of the last tokens, which graphopt's captured cache cannot express. Set model.config.use_cache = False to optimize "
            "its forward (scoring, no generation), or generate with transformers"
        )


class _Prefill(nn.Module):
    """The prompt -> the last position's logits (the only ones computed, where the model takes ``logits_to_keep``),
    each layer's keys and values."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        layers, heads, size = _cache_shape(self.model)
        empty = torch.zeros((input_ids.shape[0], heads, 0, size), dtype=next(self.model.parameters()).dtype)
        cache = _filled_cache(self.model, [empty] * layers, [empty] * layers)
        mask = _prompt_attention(attention_mask) if getattr(self.model.config, "_attn_implementation", None) == "sdpa" else attention_mask
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True, **self.last_logits_only
        )
        return (out.logits[:, -1, :], *_cache_tensors(out.past_key_values))


def _prompt_attention(attention_mask: torch.Tensor) -> torch.Tensor:
    """The prompt's attention as scaled_dot_product_attention takes it (batch, 1, query, key; True: attended): causal,
    without the pad tokens, except that a pad token attends to itself. No query is then left with nothing to attend to:
    converted by OpenVINO, such a query gives NaN, which the pad position's keys and values carry into the tokens after
    it (torch gives zeros). What a pad position computes is read by no other token: the results are unchanged."""
    length = attention_mask.shape[1]
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = (key <= query)[None, None]
    return (causal & attention_mask.bool()[:, None, None, :]) | (key == query)[None, None]


class _Decode(nn.Module):
    """One token, the mask and positions so far, the cache -> its logits and the cache one token longer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        cache = _filled_cache(self.model, keys, values)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
        return (out.logits[:, -1, :], *_cache_tensors(out.past_key_values))


def _filled_cache(model: nn.Module, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    """A transformers ``DynamicCache`` holding ``keys`` and ``values`` per layer, set directly: its ``update()`` would
    concatenate them to an empty 1-D tensor, which OpenVINO's conversion refuses."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, key, value in zip(cache.layers, keys, values, strict=True):
        layer.lazy_initialization(key, value)
        layer.keys, layer.values = key, value
    return cache


def _cache_shape(model: nn.Module) -> tuple[int, int, int]:
    """The layers, key/value heads and head size of ``model``'s cache, from its config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return layers, getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or hidden // heads


def _cache_tensors(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") for layer in layers):
        raise InvalidModelError(
            f"the model's cache is a {type(cache).__name__} without one key and one value tensor per layer: graphopt cannot capture it. "
            "Set model.config.use_cache = False to optimize its forward (scoring, no generation), or generate with transformers"
        )
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position, counting only the tokens the mask keeps (transformers' rule for left-padded batches)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


@dataclass
class Steps:
    """The two graphs of a cached language model: what runs them (torch.export's modules, or an engine's runners),
    and the programs they came from."""

    prefill: Callable[..., Any]
    decode: Callable[..., Any]
    max_length: int  # prompt + new tokens: the model's position limit
    programs: tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]
    outputs: Any  # the steps' output structure (logits, keys, values) as a pytree spec
    examples: tuple[tuple[Any, ...], tuple[Any, ...]] = ((), ())  # each step's arguments at capture (what graphopt's passes run on)
    dynamic_shapes: tuple[Any, Any] = (None, None)  # each step's dynamic dimensions at capture (torch.export's dynamic_shapes)
    rewritten: bool = False  # the graphs went through graphopt's passes: a file holds them, not the programs (`graphopt.generation_archive.saved_programs`)
    # the PyTorch engine's decode graph runs compiled by Inductor (`graphopt.generation_build.compile_decode`): ``decode``
    # is an `InductorStepRunner`, whose ``graph`` a file holds and whose compiled code load makes again
    compiled_decode: bool = False

    @property
    def graphs(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The prefill and decode graphs these steps run: a compiled decode step's graph, not its runner."""
        decode: Any = self.decode  # an InductorStepRunner where compiled
        return self.prefill, decode.graph if self.compiled_decode else decode


def on_engine(steps: Steps, engine: EngineInfo, precision: str) -> Steps:
    """``steps`` run by ``engine``: torch.export's modules on the PyTorch engine, else each program handed to the engine
    (`EngineInfo.run_program`: OpenVINO and Inductor compile it, onnxruntime exports it to ONNX, for its dynamic shapes)."""
    if engine.own_passes:
        return steps
    prefill, decode = (engine.make_program_runner(program, precision, steps.outputs) for program in steps.programs)
    return dataclasses.replace(steps, prefill=prefill, decode=decode)


def capture_steps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Steps:
    """Export the prefill and decode graphs of ``model`` (a copy graphopt owns), with the batch size, the prompt length
    and the cache length dynamic; `CaptureError` where torch.export cannot."""
    _conv1d_as_linear(model)
    ids, mask = _at_least_two(input_ids, attention_mask)
    ids, mask = ids.repeat(2, 1)[: max(2, len(ids))], mask.repeat(2, 1)[: max(2, len(mask))]  # batch 2: not specialised to 1
    position_ids = positions(mask)
    max_length = _max_length(model)
    batch, length, cached = torch.export.Dim("batch", min=1, max=MAX_BATCH), torch.export.Dim("prompt", min=1, max=max(max_length, 2)), torch.export.Dim.AUTO
    try:
        with torch.no_grad():
            prefill_dims = ({0: batch, 1: length},) * 3
            prefill = torch.export.export(_Prefill(model), (ids, mask, position_ids), dynamic_shapes=prefill_dims, strict=False)
            logits, keys, values = prefill.module()(ids, mask, position_ids)
            token = logits.argmax(-1, keepdim=True)
            grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            cache_dims = [{0: batch, 2: cached}] * len(keys)
            decode_example = (token, grown, positions(grown)[:, -1:], keys, values)
            decode_dims = ({0: batch}, {0: batch, 1: cached}, {0: batch}, cache_dims, cache_dims)
            decode = torch.export.export(_Decode(model), decode_example, dynamic_shapes=decode_dims, strict=False)
    except InvalidModelError:
        raise
    except Exception as error:  # noqa: BLE001 - torch.export's errors are many; each becomes the same advice
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}'s generation step with its key/value cache "
            f"({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}). "
            "Set model.config.use_cache = False to optimize its forward (scoring, no generation), and please report the model"
        ) from error
    outputs = pytree.tree_flatten((logits, keys, values))[1]
    examples = ((ids, mask, position_ids), decode_example)
    return Steps(prefill.module(), decode.module(), max_length, (prefill, decode), outputs, examples, (prefill_dims, decode_dims))


def _conv1d_as_linear(model: nn.Module) -> None:
    """Each transformers ``Conv1D`` of ``model`` (GPT-2's: a linear whose weight is stored input-major, run by
    ``torch.addmm``) replaced by the ``nn.Linear`` it computes, its weight transposed once: the graphs then hold linears,
    which graphopt's passes can hand to oneDNN."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Conv1D:
                linear = nn.Linear(child.nx, child.nf, device="meta")
                linear.weight = nn.Parameter(child.weight.detach().t().contiguous(), requires_grad=child.weight.requires_grad)
                linear.bias = child.bias
                setattr(parent, name, linear)


def _at_least_two(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of one token, left-padded to two: the graphs' prompt and cache lengths start at two (torch.export
    specialises sizes 0 and 1), and a masked pad changes no logit."""
    if input_ids.shape[1] >= 2:
        return input_ids, attention_mask
    return torch.cat([input_ids[:, :1], input_ids], dim=1), torch.cat([torch.zeros_like(attention_mask[:, :1]), attention_mask], dim=1)


def _max_length(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name))
    return 8192


class State:
    """One generation on the captured graphs: the mask so far, each layer's keys and values, the last logits."""

    def __init__(self, steps: Steps, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.steps = steps
        ids, self.mask = _at_least_two(ids, mask)
        self.logits, self.keys, self.values = steps.prefill(ids, self.mask, positions(self.mask))

    def advance(self, token: torch.Tensor) -> torch.Tensor:
        """The logits after one more token per sequence (``token``: shaped (batch,)), the cache one token longer."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.logits, self.keys, self.values = self.steps.decode(token[:, None], self.mask, positions(self.mask)[:, -1:], self.keys, self.values)
        return self.logits


class Generator:
    """``generate()`` on the captured prefill and decode graphs, with transformers' options and results."""

    def __init__(self, steps: Steps, generation_config: Any, report: GenerationReport) -> None:
        self.steps = steps
        self.generation_config = copy.deepcopy(generation_config)
        self.report = report

    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
        """The token ids, prompt included, as ``model.generate(input_ids, attention_mask, **options)`` returns them."""
        config = self._config(options)
        ids, mask = _check_prompt(input_ids, attention_mask)
        new_tokens = config.max_new_tokens if config.max_new_tokens is not None else max(config.max_length - ids.shape[1], 0)
        if ids.shape[0] > MAX_BATCH:
            raise InputMismatchError(f"a batch of {ids.shape[0]} prompts: generate() takes at most {MAX_BATCH} at once; split the batch")
        if ids.shape[1] + new_tokens > self.steps.max_length:
            raise InputMismatchError(
                f"a prompt of {ids.shape[1]} tokens plus max_new_tokens={new_tokens} is {ids.shape[1] + new_tokens} positions, beyond the "
                f"model's {self.steps.max_length}: shorten the prompt or ask for fewer new tokens"
            )
        eos = _token_list(config.eos_token_id)
        pad = pad_token(config)
        try:
            processors = _processors(config, ids.shape[1], eos)
        except ValueError as error:  # transformers' own check of a value (top_p=1.5), in graphopt's error
            raise InvalidOptionError(f"generate(): {error}") from error
        with torch.inference_mode():
            return self._loop(ids, mask, new_tokens, config.do_sample, processors, eos, pad)

    def _loop(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, sample: bool, processors: Any, eos: list[int], pad: int | None) -> torch.Tensor:
        unfinished, eos_tokens = torch.ones(ids.shape[0], dtype=torch.long), torch.tensor(eos, dtype=torch.long)
        state = State(self.steps, ids, mask)
        for step in range(new_tokens):
            with on_this_thread_alone():
                scores = processors(ids, state.logits.float())
                token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1) if sample else torch.argmax(scores, dim=-1)
            if eos:
                token = token * unfinished + pad * (1 - unfinished)  # type: ignore[operator]
            ids = torch.cat([ids, token[:, None]], dim=-1)
            if eos:
                unfinished = unfinished & ~torch.isin(token, eos_tokens)
            if step == new_tokens - 1 or (eos and unfinished.max() == 0):
                break
            state.advance(token)
        return ids

    def _config(self, options: dict[str, Any]) -> Any:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InvalidOptionError(
                f"generate() of an optimized model takes {', '.join(OPTIONS)}, not {', '.join(unknown)}: "
                "generate with the original model for the others"
            )
        if options.get("num_beams", 1) != 1:
            raise InvalidOptionError(f"num_beams={options['num_beams']!r}: beam search is not supported; use num_beams=1 (greedy or sampling)")
        config = copy.deepcopy(self.generation_config)
        config.update(**options)
        # what transformers' generate() takes where neither the options nor the model's generation_config say (top_k=50)
        defaults = {**_DEFAULTS, **getattr(config, "_get_default_generation_params", dict)()}
        for name, value in defaults.items():
            if getattr(config, name, None) is None:
                setattr(config, name, value)
        changed = [name for name, neutral in _NEUTRAL.items() if getattr(config, name, None) not in neutral]
        if changed or (config.num_beams or 1) != 1:
            raise InvalidOptionError(
                f"the model's generation_config sets {', '.join(changed or ['num_beams'])}, which generate() of an optimized model does not "
                "apply: reset it on model.generation_config before optimize, or generate with the original model"
            )
        return config


@functools.cache
def _openmp() -> Any:
    """The OpenMP runtime torch loaded into the process's global symbols (libgomp, on Linux), or None where there is none."""
    try:
        runtime = ctypes.CDLL(None)
        return runtime if hasattr(runtime, "omp_set_num_threads") else None
    except (OSError, TypeError):  # no process-wide symbols to look in (Windows)
        return None


@contextlib.contextmanager
def on_this_thread_alone() -> Iterator[None]:
    """torch's ops in the block run on the calling thread alone: OpenMP's thread count of this thread is 1 in it.

    Between two steps the logits processors run ops over the whole vocabulary (``min_new_tokens``'
    ``torch.where`` over GPT-2's 50,257 logits), which torch splits over its OpenMP threads; after a parallel
    region those threads spin for milliseconds waiting for more work, on the cores onnxruntime's or OpenVINO's
    own threads run the next step on. GPT-2 on onnxruntime (AMD EPYC Zen 2, 2 threads), per new token with
    ``min_new_tokens=32``: 26-29 ms, 20-23 ms with the processors on one thread. The engines on torch's threads
    lose nothing (the same threads run the next step). ``torch.set_num_threads`` would change the count of every
    thread that starts torch meanwhile, for good, so the setting changed is this thread's own OpenMP one; where the
    process has no OpenMP runtime to reach (not Linux), nothing changes.
    """
    openmp = _openmp()
    if openmp is None:
        yield
        return
    threads = torch.get_num_threads()  # torch's count for this thread (set up by its first call: not OpenMP's default)
    openmp.omp_set_num_threads(1)
    try:
        yield
    finally:
        openmp.omp_set_num_threads(threads)


def _check_prompt(input_ids: Any, attention_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point() and input_ids.shape[1] > 0):
        raise InvalidInputsError("generate() takes input_ids, a tensor of token ids shaped (batch, prompt length), at least one token")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape):
        raise InvalidInputsError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}")
    if (attention_mask[:, -1] == 0).any():
        raise InvalidInputsError("attention_mask ends in a 0: pad prompts on the left (tokenizer.padding_side = 'left') for generation")
    return input_ids.long(), attention_mask.long()


def pad_token(config: Any) -> int | None:
    """The token finished sequences are padded with: ``pad_token_id``, else the first eos token, as transformers does."""
    eos = _token_list(config.eos_token_id)
    return config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)


def _token_list(tokens: Any) -> list[int]:
    if tokens is None:
        return []
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.flatten()]
    return [int(tokens)] if isinstance(tokens, int) else [int(t) for t in tokens]


def _processors(config: Any, prompt_length: int, eos: list[int]) -> Any:
    """transformers' logits processors for ``config``, in the order its generate() applies them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if eos and config.min_length:
        processors.append(MinLengthLogitsProcessor(config.min_length, torch.tensor(eos)))
    if eos and config.min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, torch.tensor(eos)))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return processors


def timed_steps(generator: Generator, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """The prefill's seconds and the median seconds of a decode step, on the example prompt (for the report)."""
    with torch.inference_mode():
        started = clock()
        state = State(generator.steps, ids, mask)
        prefill, decode = clock() - started, []
        for _ in range(new_tokens):
            started = clock()
            state.advance(state.logits.argmax(-1))
            decode.append(clock() - started)
    return prefill, sorted(decode)[len(decode) // 2]


def decoding(generator: Generator, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> Callable[[], torch.Tensor]:
    """A call that runs ``steps`` greedy decode steps after the prompt's prefill, which its first call makes and the
    others reuse: what tune times (per new token: decode steps are most of a generation's time)."""
    prefilled: list[State] = []

    def decode() -> torch.Tensor:
        with torch.inference_mode():
            if not prefilled:
                prefilled.append(State(generator.steps, ids, mask))
            state = copy.copy(prefilled[0])  # advance() rebinds the state's tensors: the prefilled ones stay as they are
            for _ in range(steps):
                state.advance(state.logits.argmax(-1))
            return state.logits

    return decode


def cache_bytes_per_token(model: nn.Module) -> int:
    """The key/value cache's bytes for one token of one sequence: 2 x layers x key/value heads x head size x element size."""
    layers, heads, size = _cache_shape(model)
    return 2 * layers * heads * size * next(model.parameters()).element_size()


def neutral_config(generation_config: Any) -> Any:
    """A copy of ``generation_config`` without the settings generate() does not apply (each at its neutral value)."""
    neutral = copy.deepcopy(generation_config)
    for name, values in _NEUTRAL.items():
        if hasattr(neutral, name) and getattr(neutral, name) not in values:
            setattr(neutral, name, values[0])
    return neutral


def without_cache(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose forward returns no cache (``config.use_cache = False``): the graph its calls run."""
    calls = copy.deepcopy(model)
    calls.config.use_cache = False
    return calls


def prompt_of(example_inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The example prompt: ``input_ids`` and ``attention_mask`` from a dict of them, or the ids alone (a tensor, or the
    first of a tuple); `InvalidInputsError` otherwise."""
    if isinstance(example_inputs, dict):
        ids, mask = example_inputs.get("input_ids"), example_inputs.get("attention_mask")
    elif isinstance(example_inputs, (tuple, list)) and example_inputs:
        ids, mask = example_inputs[0], None
    else:
        ids, mask = example_inputs, None
    if not isinstance(ids, torch.Tensor):
        raise InvalidInputsError(
            "a causal language model's example inputs are {'input_ids': ids, 'attention_mask': mask} (token ids shaped (batch, length)), "
            "e.g. tokenizer(texts, return_tensors='pt', padding=True) with tokenizer.padding_side = 'left'"
        )
    return _check_prompt(ids, mask)
