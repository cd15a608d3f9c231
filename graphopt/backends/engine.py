"""The engine interface: what every runtime an optimized graph can be handed to provides.

An engine is an existing runtime (OpenVINO, onnxruntime, Inductor), never one of
graphopt's own. `graphopt.optimize(..., engine=...)` captures the model, runs the portable
passes (those whose result any runtime can express: `graphopt.pipeline.portable_passes`),
verifies them, and hands the graph to the engine's `EngineInfo.build`, which returns an
`EngineRunner`. The runner's outputs are then verified against the original model like a
pass's, on the example and on a second input with other sizes of each dynamic dimension,
and it becomes the ``runner`` of the `OptimizedModule` handed back: the same input checks,
report and ``why()`` as any result. The PyTorch engine (``build=None``) is graphopt's own
runtime: the layout, precision and CPU-kernel passes run as well and the graph itself is
the result (the default).

An engine never sees the user's model, only graphopt's captured graph: that is how graphopt
opens an engine to models it cannot take directly (OpenVINO's TorchScript tracing fails on
ViT-B/16; its torch.export path, which graphopt takes, works).

Engines other than PyTorch serve inference only (their graphs have no autograd), and
import their runtime where they use it, so that ``import graphopt`` does not load it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from graphopt.dynamic import Dims
from graphopt.errors import EngineError, GraphoptError, error_summary
from graphopt.side_effects import state_writes


@dataclass(frozen=True)
class EngineInput:
    """What an engine builds from: graphopt's verified graph and the example it was verified on."""

    graph_module: fx.GraphModule  # after the portable passes; an engine must not change it
    example_inputs: tuple[Any, ...]  # forward()'s positional arguments (copies: an engine may run them)
    dims: Dims  # per pytree leaf of example_inputs, the dimensions calls may take other sizes of
    precision: str  # "fp32", or a low precision from the engine's `EngineInfo.precisions` ("int8": see `calibration`)
    # what builds of this same graph share (tune builds each engine in each precision from one graph): see `reused`
    conversions: dict[str, Any] = field(default_factory=dict)
    # precision="int8": the batches the engine calibrates on (forward()'s positional arguments), and the output error
    # budget the engine's result must keep (`graphopt.backends.int8_budget`)
    calibration: tuple[tuple[Any, ...], ...] = ()
    accuracy: float | None = None

    def reused(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()``, made once per graph: the other builds from the same graph (another precision, another
        engine under ``tune=True``) get the same object, so it must not be changed once made."""
        if name not in self.conversions:
            self.conversions[name] = make()
        return self.conversions[name]


class EngineRunner(nn.Module):
    """What an engine built: ``forward(*args)`` runs it on forward()'s positional arguments and returns the
    outputs in the graph's structure (tensors on the inputs' device).

    ``forward`` is the one place an engine call runs: each engine implements `run`, and an error its
    runtime raises on a call becomes `EngineError`. Calls may come from several threads at once (a web
    server's workers, a pool), on the module and on its copies: `run` must compute right in each, so
    an engine keeps per thread whatever its runtime does not share safely (OpenVINO's infer requests).
    Copies share the built engine (it is immutable once built; a deep copy of an
    `OptimizedModule` must not rebuild it). ``save`` writes what `EngineInfo.load` reads back.
    """

    engine: str = ""
    # what the report says of the build (int8: the layers in int8, those kept in float and why)
    notes: tuple[str, ...] = ()
    # precision="int8" where no layer stayed in int8 within the budget: the engine's float32 result
    int8_fell_back: bool = False

    def forward(self, *args: Any) -> Any:
        try:
            return self.run(args)
        except GraphoptError:
            raise
        except Exception as error:  # the runtime's own error on inputs graphopt's checks accepted
            raise EngineError(
                f"engine={self.engine!r} failed on this call ({error_summary(error)}), although the inputs are of the kind it was built and "
                "verified for: call the original model, or optimize with engine='pytorch' (the default), and please report the model"
            ) from error

    def run(self, args: tuple[Any, ...]) -> Any:
        """Run the engine on ``args`` (forward()'s positional arguments); safe to call from several threads at once."""
        raise NotImplementedError

    def save(self, folder: Path) -> dict[str, Any]:
        """Write the engine's own files into ``folder``; return the JSON-ready settings `EngineInfo.load` needs with them."""
        raise NotImplementedError

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineRunner:
        return self


@dataclass(frozen=True)
class EngineInfo:
    """One engine's registry entry (`graphopt.backends.ENGINES`), as `PassInfo` is a pass's."""

    name: str  # the value of optimize(engine=...)
    description: str  # one line for `graphopt engines` and the README
    precisions: tuple[str, ...]  # the precision= values it computes in ("fp32" first)
    # the module that must be importable, and the pip extra that installs it (None: part of graphopt's core)
    requires: str | None = None
    extra: str | None = None
    # building it compiles for minutes on large models (its `costs` say so; the tests mark its builds slow)
    compiles: bool = False
    # graph -> runner (None: graphopt's own PyTorch runtime, whose passes make the result)
    build: Callable[[EngineInput], EngineRunner] | None = None
    # (folder written by EngineRunner.save, its settings, the graph saved beside it, example inputs) -> the runner again
    load: Callable[[Path, Mapping[str, Any], fx.GraphModule, tuple[Any, ...]], EngineRunner] | None = None
    costs: str = ""  # what choosing it costs: build time, file size, no autograd
    # (torch.export program whose shapes change with every call, precision, output structure) -> runner: a language
    # model's generation steps (`graphopt.generation`); None: the engine does not run them
    run_program: Callable[[torch.export.ExportedProgram, str, pytree.TreeSpec], EngineRunner] | None = None
    # the precision= values `run_program` generates in (int8: the weights alone, compressed without calibration data)
    generation_precisions: tuple[str, ...] = ("fp32",)
    # (folder the runner run_program made wrote (EngineRunner.save), its settings, the program, the output structure) -> that
    # runner again, for a saved generate() (`graphopt.generation_archive`); an engine with run_program has it
    load_program: Callable[[Path, Mapping[str, Any], torch.export.ExportedProgram, pytree.TreeSpec], EngineRunner] | None = None

    @property
    def own_passes(self) -> bool:
        """Whether graphopt's layout, precision and CPU-kernel passes make the result (the PyTorch engine)."""
        return self.build is None

    @property
    def generates(self) -> bool:
        """Whether a language model's generate() runs on it: the PyTorch engine, or one with `run_program`."""
        return self.own_passes or self.run_program is not None

    def missing(self) -> str | None:
        """Why this engine cannot run here (its runtime is not installed, or its import fails), or None."""
        if self.requires is None:
            return None
        install = f"pip install 'graphopt[{self.extra}]'" if self.extra else f"pip install {self.requires}"
        if importlib.util.find_spec(self.requires) is None:
            return f"engine={self.name!r} needs {self.requires}, which is not installed: {install}"
        try:  # installed is not enough: a broken install (a missing library, a version clash) fails on import
            importlib.import_module(self.requires)
        except Exception as error:
            return f"engine={self.name!r} needs {self.requires}, which is installed but fails to import ({error_summary(error)}): reinstall it ({install} --force-reinstall)"
        return None

    def version(self) -> str:
        """The installed version of its runtime (torch's for an engine of graphopt's core); "" where it is missing."""
        if self.requires is None:
            return torch.__version__
        if self.missing() is not None:
            return ""
        return str(getattr(importlib.import_module(self.requires), "__version__", ""))

    def make(self, request: EngineInput) -> EngineRunner:
        """``build(request)``, where any error the engine's own tools raise (conversion, compilation, quantization,
        a capability check) becomes `EngineError`: the one place engine builds are called."""
        self.check_installed()
        try:
            return self.build(request)  # type: ignore[misc]
        except GraphoptError:
            raise
        except Exception as error:
            raise EngineError(f"engine={self.name!r} could not build graphopt's graph ({error_summary(error)}): use another engine, and please report the model") from error

    def make_program_runner(self, program: torch.export.ExportedProgram, precision: str, outputs: pytree.TreeSpec) -> EngineRunner:
        """``run_program(program, precision, outputs)``, its tools' errors as `EngineError`, as `make` does for graphs."""
        self.check_installed()
        try:
            return self.run_program(program, precision, outputs)  # type: ignore[misc]
        except GraphoptError:
            raise
        except Exception as error:
            raise EngineError(f"engine={self.name!r} could not convert or compile the generation step ({error_summary(error)}): use another engine") from error

    def check_installed(self) -> None:
        """Raise `EngineError` naming the extra to install where the runtime is missing."""
        reason = self.missing()
        if reason is not None:
            raise EngineError(reason)

    def check_graph(self, graph_module: fx.GraphModule, args: tuple[Any, ...]) -> None:
        """Raise `EngineError` where this engine cannot compute what ``graph_module`` computes on every call: a graph that
        writes its buffers or parameters (``self.steps += 1`` in forward()) computes each call from the state the one before
        left, and an engine holds its own copy of them, fixed when it is built. The PyTorch engine runs the graph itself."""
        if self.own_passes:
            return
        written = state_writes(graph_module, args)
        if written:
            names = ", ".join(map(repr, written[:3])) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
            raise EngineError(
                f"engine={self.name!r} cannot run this model: its forward() writes the stored tensors {names} on every call, and the engine computes "
                "with its own copy of the weights and buffers, fixed when it is built, so every call would start from the first "
                "call's state and the updates would be lost. Use engine='pytorch' (the default), which runs the updates; or move "
                "them out of forward() (e.g. into the loop that calls the model) to serve the model with this engine."
            )


def output_structure(graph_module: fx.GraphModule, args: tuple[Any, ...]) -> pytree.TreeSpec:
    """The pytree structure of the graph's outputs on ``args`` (engines return flat lists of tensors)."""
    with torch.no_grad():
        return pytree.tree_flatten(graph_module(*args))[1]


def tensor_leaves(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors among ``args``' pytree leaves, in order: what an exported program takes as inputs.

    Other leaves (numbers, strings, None) are fixed at the example's values by the export and
    checked by the `OptimizedModule`'s input signature before a call reaches the engine.
    """
    return [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]


def export_program(graph_module: fx.GraphModule, args: tuple[Any, ...], dims: Dims, engine: str) -> torch.export.ExportedProgram:
    """torch.export's program of ``graph_module`` with the dimensions in ``dims`` dynamic.

    Raises `EngineError` with torch.export's own error, or where torch.export fixed a
    dimension the optimized module was verified to take other sizes of.
    """
    leaves, spec = pytree.tree_flatten(args)
    shapes = [
        {dim: torch.export.Dim.AUTO for dim in sorted(mine)} or None if isinstance(leaf, torch.Tensor) else None
        for leaf, mine in zip(leaves, dims, strict=True)
    ]
    dynamic_shapes = pytree.tree_unflatten(shapes, spec)
    try:
        with torch.no_grad():
            program = torch.export.export(graph_module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        raise EngineError(f"engine={engine!r}: torch.export could not export graphopt's graph for it ({error_summary(error)})") from error
    inputs = [node.meta.get("val") for node in program.graph.find_nodes(op="placeholder") if node.name in set(program.graph_signature.user_inputs)]
    tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
    fixed = [
        f"input {index} dim {dim}"
        for index, (tensor, mine) in enumerate(zip(tensors, [m for leaf, m in zip(leaves, dims, strict=True) if isinstance(leaf, torch.Tensor)], strict=True))
        for dim in sorted(mine)
        if is_concrete_int(tensor.shape[dim])  # torch.export keeps a fixed dimension as a SymInt of a constant
    ]
    if fixed:
        raise EngineError(
            f"engine={engine!r}: torch.export fixed {', '.join(fixed)} to the example's size: the model's code ties it to a "
            "constant. Optimize with dynamic_shapes=None (every size fixed) or without those dimensions."
        )
    return program
