"""int8 on an engine, held to graphopt's accuracy budget: which convs and linears the engine may quantize.

The engines quantize with their own post-training tools (OpenVINO through NNCF, onnxruntime
through its static QDQ quantizer), which quantize every layer they can and say nothing of the
error. graphopt governs them with the budget of ``optimize(precision="int8", accuracy=...)``,
as its own `quantize_int8` pass does, and tells them which layers to leave in float:

1. `int8_layers`: the convs and linears of graphopt's graph (``nn.Conv2d``, ``nn.Linear``
   modules), named by their module paths, the names the report uses.
2. `sensitivity`: each layer's output error alone in int8, every other layer in float,
   measured in PyTorch with fake quantization (per-tensor affine uint8 activations from the
   calibration batches' range, per-channel symmetric int8 weights: onnxruntime's scheme; NNCF
   quantizes activations symmetrically) on the example inputs. It ranks the layers; it is not
   the engine's error (on the digits CNN every layer alone is near 3e-3 while NNCF's int8 of
   all of them reaches 7e-2), which is why the engine's own result decides.
3. `within_budget`: the engine quantizes every layer; its own result is measured on the example
   inputs and the calibration batches (graphopt's outputs in float32 are the reference). Only
   when that is over the budget are the layers ranked (2.): those over the budget alone stay in
   float, and while the result is over the budget, the layers with the largest errors alone go
   back to float too (one, then two, four, ...: a few quantizations, not one per layer). Where
   that leaves none in int8, the engine quantizes once more with every layer in float: still over
   the budget, the ops it quantizes besides the layers are the cause (NNCF's int8 of EfficientNet-B0's
   additions, means and products alone: 5.4e-2 of the output's scale), no choice of layers can
   help, and the search stops (it went on to quantize once per layer: 89 quantizations on that
   model, for nothing). Within the budget, the PyTorch ranking missed what the engine's int8 does to some layer
   (on an AMX Xeon, OpenVINO's int8 of the digits CNN's one-channel first conv alone reaches 6.7e-2,
   while fake quantization says 2.3e-3): each layer alone is measured on the engine (one
   quantization per layer) and the search runs again on that ranking. Where none is left in int8
   still, the caller builds the engine's float32 result instead.

Each engine maps the layer paths to its own ops (`Int8Layer.weight` finds a conv in
OpenVINO's model; onnxruntime's nodes carry the module path in their metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import MinMaxObserver

from graphopt import verify
from graphopt.backends.engine import EngineInput
from graphopt.errors import EngineError

Built = TypeVar("Built")


@dataclass(eq=False)
class Int8Layer:
    """A conv or linear of graphopt's graph that an engine may run in int8."""

    path: str  # its module path in the graph ("layer1.0.conv1")
    module: nn.Conv2d | nn.Linear
    error: float = 0.0  # the output's error with this layer alone in int8 (fake-quantized), relative to its scale

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight.detach()


@dataclass
class Int8Outcome(Generic[Built]):
    """What `within_budget` chose: the engine's quantized result (None: no layer stays in int8) and why layers stay in float."""

    built: Built | None
    error: float  # the result's largest output error on the example inputs and calibration batches
    in_float: dict[str, str] = field(default_factory=dict)  # layer path -> why it stays in float
    quantizations: int = 0  # how many times the engine quantized
    # where no layer stayed in int8: the error with every layer in float, what the engine's int8 of the ops it quantizes
    # besides them (the activations before additions, means and products: NNCF's defaults) costs alone; None: not measured
    floor: float | None = None

    def notes(self, layers: Sequence[Int8Layer], accuracy: float, engine: str) -> list[str]:
        """The report's lines: how many layers run in int8, the error reached, and each layer kept in float with why."""
        int8 = len(layers) - len(self.in_float)
        lines = [
            f"{int8} of {len(layers)} convs/linears in int8 by {engine} ({self.quantizations} quantization(s)); output error at most "
            f"{self.error:.1e} of its scale on the example inputs and the calibration batches, accuracy={accuracy:g}"
        ]
        if self.floor is not None and self.floor > accuracy:
            lines.append(
                f"with every conv and linear in float, {engine}'s int8 of the other ops it quantizes still changed the output by "
                f"{self.floor:.1e}, over accuracy={accuracy:g}: no choice of layers in float brings it within, so the search stopped there"
            )
        return lines + [f"{path}: kept in float: {reason}" for path, reason in self.in_float.items()]


def int8_layers(graph_module: fx.GraphModule) -> list[Int8Layer]:
    """The float32 ``nn.Conv2d`` and ``nn.Linear`` modules the graph calls, in graph order."""
    layers = []
    for node in graph_module.graph.find_nodes(op="call_module"):
        module = graph_module.get_submodule(str(node.target))
        if isinstance(module, (nn.Conv2d, nn.Linear)) and module.weight.dtype == torch.float32:
            layers.append(Int8Layer(str(node.target), module))
    return layers


def _fake_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """Per output channel, symmetric int8."""
    scale = weight.abs().flatten(1).amax(dim=1).clamp(min=1e-12) / 127
    return torch.fake_quantize_per_channel_affine(weight, scale, torch.zeros_like(scale, dtype=torch.int32), 0, -128, 127)


def sensitivity(graph_module: fx.GraphModule, layers: Sequence[Int8Layer], calibration: Sequence[tuple[Any, ...]], example: tuple[Any, ...]) -> None:
    """Set each layer's ``error``: the output error on ``example`` with it alone fake-quantized to int8.

    Activations get the range of the layer's input over ``calibration``. The graph is not changed
    (hooks, and the weight swapped for the one call by ``torch.func.functional_call``).
    """
    observers = {layer: MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine) for layer in layers}

    def observe(layer: Int8Layer) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            observers[layer](args[0].detach().float())

        return hook

    handles = [layer.module.register_forward_pre_hook(observe(layer)) for layer in layers]
    try:
        with verify.isolated(graph_module):
            for batch in calibration:
                graph_module(*batch)
    finally:
        for handle in handles:
            handle.remove()
    with verify.isolated(graph_module):
        expected = graph_module(*example)
        for layer in layers:
            scale, zero_point = observers[layer].calculate_qparams()

            def quantize_input(_: nn.Module, args: tuple[Any, ...], scale: float = float(scale), zero_point: int = int(zero_point)) -> tuple[Any, ...]:
                return (torch.fake_quantize_per_tensor_affine(args[0], scale, zero_point, 0, 255), *args[1:])

            handle = layer.module.register_forward_pre_hook(quantize_input)
            try:
                actual = torch.func.functional_call(graph_module, {f"{layer.path}.weight": _fake_int8_weight(layer.weight)}, example, strict=False)
            finally:
                handle.remove()
            layer.error = verify.compare(expected, actual).max_error


def within_budget(
    rank: Callable[[], Sequence[Int8Layer]], accuracy: float, quantize: Callable[[frozenset[str]], Built], error: Callable[[Built], float]
) -> Int8Outcome[Built]:
    """The engine's int8 result within ``accuracy``, leaving the fewest, most sensitive layers in float.

    ``quantize(paths)``: the engine's quantized result with the layers at ``paths`` left in float;
    ``error(result)``: its largest output error on the checks. Every layer in int8 is tried first;
    over the budget, ``rank()`` gives the layers with their errors alone (`sensitivity`), those over
    the budget alone go to float, and while the result is over the budget the next 1, 2, 4, ...
    layers by error alone join them. Where that leaves no layer in int8, every layer goes to float
    once: over the budget still, what the engine quantizes besides them is the cause, no choice of
    layers helps, and the search stops (`Int8Outcome.floor`). Within it, the ranking (measured in
    PyTorch) missed what the engine's own int8 does to a layer (OpenVINO's int8 convolution of a
    one-channel image on AMX): each layer's error alone is then measured on the engine itself (one
    quantization per layer) and the search runs again on that ranking.
    """
    built = quantize(frozenset())
    reached = error(built)
    if reached <= accuracy:
        return Int8Outcome(built, reached, {}, 1)
    layers = rank()
    outcome = _search(layers, accuracy, quantize, error, reached, "alone in int8")
    outcome.quantizations += 1
    if outcome.built is not None or len(layers) < 2:
        return outcome
    every = frozenset(layer.path for layer in layers)
    outcome.floor, outcome.quantizations = error(quantize(every)), outcome.quantizations + 1
    if outcome.floor > accuracy:  # what the engine quantizes besides the layers is over the budget alone: no choice of them helps
        return outcome
    on_engine = [replace(layer, error=error(quantize(every - {layer.path}))) for layer in layers]
    second = _search(on_engine, accuracy, quantize, error, reached, "alone in int8 on the engine")
    second.quantizations += outcome.quantizations + len(layers)
    return second if second.built is not None else replace(outcome, quantizations=second.quantizations)


def _search(
    layers: Sequence[Int8Layer], accuracy: float, quantize: Callable[[frozenset[str]], Built], error: Callable[[Built], float], reached: float, alone: str
) -> Int8Outcome[Built]:
    """`within_budget`'s search from every layer in int8 (``reached``: that result's error), ``layers`` ranked by their ``error``."""
    in_float: dict[str, str] = {}
    quantizations, tried = 0, frozenset[str]()
    for layer in sorted(layers, key=lambda layer: layer.error, reverse=True):  # the worst first, as the report lists them
        if layer.error > accuracy:
            in_float[layer.path] = f"{alone} it changes the output by {layer.error:.1e} of its scale, over accuracy={accuracy:g}"
    rest = sorted((layer for layer in layers if layer.path not in in_float), key=lambda layer: layer.error, reverse=True)
    step = 1
    while True:
        if frozenset(in_float) == tried:  # nothing new over the budget alone: the next layers by error alone
            if not rest:
                break
            for layer in rest[:step]:
                in_float[layer.path] = (
                    f"{alone} it changes the output by {layer.error:.1e} of its scale; with it the int8 layers together "
                    f"changed it by {reached:.1e}, over accuracy={accuracy:g}, and it was among the largest errors alone"
                )
            rest, step = rest[step:], step * 2
        if len(in_float) == len(layers):  # every layer it can leave in float is there
            break
        tried = frozenset(in_float)
        built, quantizations = quantize(tried), quantizations + 1
        reached = error(built)
        if reached <= accuracy:
            return Int8Outcome(built, reached, in_float, quantizations)
    return Int8Outcome(None, reached, in_float, quantizations)


def budget_checks(graph_module: fx.GraphModule, example: tuple[Any, ...], calibration: Sequence[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], Any]]:
    """(arguments, graphopt's float32 outputs) on the example inputs and each calibration batch: what `within_budget` measures on."""
    with verify.isolated(graph_module):
        return [(args, graph_module(*args)) for args in (example, *calibration)]


def largest_error(checks: Sequence[tuple[tuple[Any, ...], Any]], run: Callable[..., Any]) -> float:
    """The largest output error of ``run`` over ``checks``, relative to each output's scale."""
    return max(verify.compare(expected, run(*args)).max_error for args, expected in checks)


def graph_layers(request: EngineInput) -> list[Int8Layer]:
    """`int8_layers` of the request's graph, found once per graph (the same objects for every build from it)."""
    return request.reused("int8 layers", lambda: int8_layers(request.graph_module))


def quantized_within_budget(
    request: EngineInput,
    engine: str,
    quantize: Callable[[frozenset[str]], Built],
    run: Callable[[Built], Callable[..., Any]],
    found: Callable[[], Collection[str]],
) -> tuple[Int8Outcome[Built], list[Int8Layer]]:
    """`within_budget` for an engine's build of ``request`` (``precision="int8"``), measured on the example and the
    calibration batches; the layers are ranked once per graph (`EngineInput.reused`: tune's other int8 engine gets
    them). ``found()``: the paths of the layers the engine can leave in float (it found their ops); the others stay
    in the engine's int8 whatever the budget, so they are never reported as kept in float."""
    if not request.calibration or request.accuracy is None:
        raise EngineError(f"engine={engine!r}, precision='int8' needs calibration= batches and an accuracy budget")
    graph, example = request.graph_module, request.example_inputs
    layers = graph_layers(request)

    def rank() -> list[Int8Layer]:
        request.reused("int8 sensitivity", lambda: sensitivity(graph, layers, request.calibration, example))
        placeable = found()
        return [layer for layer in layers if layer.path in placeable]

    checks = request.reused("int8 checks", lambda: budget_checks(graph, example, request.calibration))
    return within_budget(rank, request.accuracy, quantize, lambda built: largest_error(checks, run(built))), layers
