"""Run every variant of every model in one process and measure them side by side.

For each model: build the model once (eval mode, on the device) and, variant by variant,
build the variant, make its first call (the setup time includes it: compilers work
then) and its warm-up calls, recording peak memory meanwhile, and the output error
against eager fp32. Then time all variants that built, interleaved in shuffled rounds (`timing.round_order`),
one call per variant per round; each round's ratio is eager fp32's time in that round
divided by the variant's. A variant that is skipped or fails is recorded with the
reason; the run goes on.

Timing: ``time.perf_counter`` on the CPU; on CUDA, CUDA events around the call, after
synchronising the device (so the previous call's queued work is not counted), and
waiting for the end event (so the call's own work is). onnxruntime's ``run`` returns
host arrays, so its calls include their copies. ``torch.backends.cudnn.benchmark`` is
on for CUDA runs (fixed input shapes).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above the allocation level
before the variant was built (torch allocations only). On the CPU, resident memory
(RSS) of the process sampled every millisecond while the variant was built, called and
warmed up, above the level before, after freed memory was handed back to the OS;
memory an earlier variant freed but the allocator kept can be reused without showing,
so it is a lower bound (it includes weights copied by the variant).

Roofline: each model's floating-point operations per call are counted once on eager fp32
(``torch.utils.flop_counter``: convolutions, matrix products, attention; two per
multiply-add), and the machine's matrix-multiply rate is measured at the start of the run,
in the same process and threads, in fp32 and in the run's low precision (a square
``torch.mm``, median of timed calls). A variant's roofline fraction is its achieved FLOP/s
over the rate of its precision class (`graphopt.bench.results`).

Foreign load: the CPU time of other processes while timing (`graphopt.timing.ForeignLoad`,
the measurement ``optimize``'s measured decisions use too); above
`graphopt.timing.FOREIGN_LOAD_LIMIT` cores on average, the model's results carry a warning, as
does a busy machine at the start (load average).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.bench.results import FOREIGN_CPU_WARNING, BenchResult, ModelResult, VariantResult
from graphopt.bench.variants import LOW_PRECISIONS, Runner, Setup, Variant, VariantSkipped
from graphopt.timing import ForeignLoad, interleaved_samples, wall_clock_seconds

try:
    import psutil
except ImportError:  # memory and foreign-load measurement degrade to "unknown"
    psutil = None

Measure = Callable[[Runner], float]
MIB = 1024 * 1024


@dataclass(frozen=True)
class BenchModel:
    """A model to benchmark: a name, a factory and its example inputs (with the batch size)."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]


def cuda_event_seconds(run: Runner) -> float:
    """Seconds one call takes on the current CUDA stream, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # work queued before this call is not counted
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _arrays(outputs: Any) -> list[torch.Tensor]:
    """The tensors (or onnxruntime's numpy arrays, as tensors) in a nested output."""
    return [torch.as_tensor(leaf) for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, (torch.Tensor, np.ndarray))]


def relative_error(expected: Any, actual: Any) -> float:
    """Largest ``max|actual - expected| / max|expected|`` over the output tensors (inf when their structure differs)."""
    expected_leaves, actual_leaves = _arrays(expected), _arrays(actual)
    if len(expected_leaves) != len(actual_leaves):
        return float("inf")
    worst = 0.0
    for want, got in zip(expected_leaves, actual_leaves):
        want, got = want.detach().double().cpu(), got.detach().double().cpu()
        if want.shape != got.shape:
            return float("inf")
        if want.numel() == 0:
            continue
        scale = want.abs().max().item()
        difference = (want - got).abs().max().item()
        worst = max(worst, difference / scale if scale > 0 else difference)
    return worst


def _release_freed_memory(device: torch.device) -> None:
    """Collect garbage and hand freed memory back (glibc's malloc_trim, CUDA's cache), for the next measurement."""
    gc.collect()
    library = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(library), "malloc_trim", None) if library else None
    if trim is not None:
        trim(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _PeakMemory:
    """Peak memory growth inside a ``with`` block, in MiB (None when it cannot be measured)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.grown_mb: float | None = None
        self._stop = threading.Event()
        self._baseline = self._peak = 0

    def __enter__(self) -> _PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        elif psutil is not None:
            self._process = psutil.Process()
            self._baseline = self._peak = self._process.memory_info().rss
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            self.grown_mb = (torch.cuda.max_memory_allocated(self.device) - self._baseline) / MIB
        elif psutil is not None:
            self._stop.set()
            self._sampler.join()
            self._peak = max(self._peak, self._process.memory_info().rss)
            self.grown_mb = (self._peak - self._baseline) / MIB


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            "growth of torch.cuda.max_memory_allocated over building, first call and warm-up of the variant "
            "(torch's allocations only: onnxruntime's are not counted)"
        )
    if psutil is None:
        return "not measured: psutil is not installed (pip install psutil)"
    return (
        "growth of the process's resident memory (RSS, sampled every 1 ms) over building, first call and warm-up "
        "of the variant, after freed memory was returned to the OS; a lower bound, since memory freed by earlier "
        "variants and kept by the allocator is reused without showing"
    )


def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s), or the platform's processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """The CPU features that decide low-precision speed (AVX-512, bf16, AMX), where the OS tells."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})
    return []


def machine_info(device: torch.device) -> dict[str, Any]:
    import onnxruntime

    return {
        "cpu": cpu_name(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _product(dtype: torch.dtype, n: int, device: torch.device, generator: torch.Generator) -> Callable[[], Any]:
    """One ``n`` x ``n`` matrix product in ``dtype``: ``torch.mm``, or for int8 oneDNN's uint8 x int8 kernel, which
    graphopt's and the peers' int8 layers run (``torch._int_mm`` has no fast path on CPUs without VNNI)."""
    if dtype != torch.int8:
        a, b = (torch.randn(n, n, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
        return lambda: torch.mm(a, b)
    x = torch.randint(0, 128, (n, n), generator=generator, dtype=torch.uint8)
    weight = torch.ops.onednn.qlinear_prepack(torch.randint(-127, 128, (n, n), generator=generator, dtype=torch.int8), [n, n])
    scales, zero_points = torch.ones(n), torch.zeros(n, dtype=torch.long)
    return lambda: torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, weight, scales, zero_points, None, 1.0, 0, torch.float32, "none", [], "none")


def matmul_gflops(dtype: torch.dtype, size: int, device: torch.device, budget_s: float = 1.0) -> float:
    """The rate of a ``size`` x ``size`` matrix product in ``dtype`` on ``device``, in GFLOP/s (median of timed calls).

    int8 (CPU) is counted in the same operations, two per multiply-add (`_product`). A
    512 x 512 probe runs first: when it shows the full size would take over five times
    ``budget_s`` a call (bf16 on a CPU without bf16 instructions runs some 100x slower than
    fp32), the probe's rate is returned instead.
    """
    generator = torch.Generator().manual_seed(0)

    def rate(n: int, calls_budget_s: float) -> float:
        multiply = _product(dtype, n, device, generator)
        seconds: list[float] = []
        with torch.inference_mode():
            multiply()  # warm-up: oneDNN/MKL pick and cache their kernels
            _synchronize(device)
            started = time.perf_counter()
            while len(seconds) < 3 or (len(seconds) < 50 and time.perf_counter() - started < calls_budget_s):
                call_started = time.perf_counter()
                multiply()
                _synchronize(device)
                seconds.append(time.perf_counter() - call_started)
        return 2 * n**3 / float(np.median(seconds)) / 1e9

    probe_size = min(size, 512)
    probe = rate(probe_size, 0.0)
    if probe_size == size or 2 * size**3 / (probe * 1e9) > 5 * budget_s:
        return probe
    return rate(size, budget_s)


def count_flops(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> float | None:
    """Floating-point operations of one eager call (two per multiply-add), None when torch's counter fails on it."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            model(*inputs)
    except Exception:  # the counter is a measurement aid: a model it cannot follow just has no roofline figure
        return None
    return float(counter.get_total_flops()) or None


def _failure(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


class _CallFailed(Exception):
    def __init__(self, key: str, error: BaseException) -> None:
        super().__init__(key)
        self.key, self.reason = key, _failure(error)


def _guarded(key: str, run: Runner) -> Runner:
    def call() -> Any:
        try:
            return run()
        except Exception as error:
            raise _CallFailed(key, error) from error

    return call


def _in_inference_mode(run: Runner) -> Runner:
    def call() -> Any:
        with torch.inference_mode():
            return run()

    return call


class Harness:
    """Measures models variant by variant; see the module docstring for the method."""

    def __init__(
        self,
        variants: Sequence[Variant],
        *,
        device: str | torch.device = "cpu",
        rounds: int = 20,
        warmup: int = 3,
        low_precision: str = "bf16",
        time_budget_s: float | None = None,
        measure: Measure | None = None,
        matmul_size: int = 2048,
        log: Callable[[str], None] = print,
    ) -> None:
        if not variants or variants[0].role != "baseline":
            raise ValueError("the first variant must be the eager fp32 baseline")
        self.variants = list(variants)
        self.device = torch.device(device)
        self.rounds, self.warmup, self.low_precision = rounds, warmup, low_precision
        self.deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        self.time_budget_s = time_budget_s
        self.measure = measure or (cuda_event_seconds if self.device.type == "cuda" else wall_clock_seconds)
        self.matmul_size = matmul_size
        self._rates: dict[str, float] | None = None
        self.log = log

    @property
    def rates(self) -> dict[str, float]:
        """The machine's matrix-multiply rate in fp32, the low precision and (CPU) int8, GFLOP/s (measured on first use)."""
        if self._rates is None:
            dtypes = {"fp32": torch.float32, self.low_precision: LOW_PRECISIONS[self.low_precision]}
            if self.device.type == "cpu":
                dtypes["int8"] = torch.int8
            self._rates = {name: matmul_gflops(dtype, self.matmul_size, self.device) for name, dtype in dtypes.items()}
        return self._rates

    def new_result(self, command: str) -> BenchResult:
        machine = machine_info(self.device)
        machine["matmul_size"] = self.matmul_size
        machine["matmul_gflops"] = self.rates
        result = BenchResult(
            command=command,
            machine=machine,
            settings={
                "rounds": self.rounds,
                "warmup": self.warmup,
                "device": str(self.device),
                "low_precision": self.low_precision,
                "time_budget_s": self.time_budget_s,
                "variants": [variant.key for variant in self.variants],
            },
            memory_method=memory_method(self.device),
        )
        load = machine["load_average_at_start"]
        if load is not None and load[0] > 0.5 * (machine["cores"] or 1):
            result.warnings.append(
                f"the machine was busy before the run (1-minute load average {load[0]:.1f} on {machine['cores']} cores): "
                "figures may be distorted; rerun on a quiet machine"
            )
        if psutil is None:
            result.warnings.append("foreign CPU load not measured: psutil is not installed (pip install psutil)")
        return result

    def run_model(self, spec: BenchModel) -> ModelResult:
        """Build, check and time every variant of one model."""
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        try:
            model = spec.build().eval().to(self.device)
            inputs = tuple(t.to(self.device) for t in spec.inputs())
        except Exception as error:
            return ModelResult(spec.name, [], error=f"could not build it: {_failure(error)}")
        result = ModelResult(spec.name, [list(t.shape) for t in inputs], flops=count_flops(model, inputs))
        low_skipped = self._low_precision_skipped()
        runners: dict[str, Runner] = {}
        reference: Any = None
        with tempfile.TemporaryDirectory(prefix="graphopt-bench-") as workdir:
            setup = Setup(model, inputs, self.device, self.low_precision, Path(workdir))
            for variant in self.variants:
                outcome = VariantResult(
                    variant.key, variant.label, variant.role, class_default=variant.class_default, int8=variant.precision == "int8", direct=variant.direct
                )
                result.variants.append(outcome)
                if self.deadline is not None and time.monotonic() > self.deadline:
                    outcome.status, outcome.reason = "skipped", f"time budget of {self.time_budget_s:.0f} s spent"
                    continue
                if variant.role != "baseline" and reference is None:
                    outcome.status, outcome.reason = "skipped", "eager fp32 did not run: nothing to compare with"
                    continue
                if variant.precision == "low" and low_skipped:
                    outcome.status, outcome.reason = "skipped", low_skipped
                    continue
                output = self._prepare(variant, setup, outcome, runners)
                if outcome.status == "ok":
                    reference = output if variant.role == "baseline" else reference
                    outcome.max_error = relative_error(reference, output)
                status = f"set up in {outcome.setup_s:.2f} s" if outcome.status == "ok" else f"{outcome.status}: {outcome.reason}"
                self.log(f"{spec.name}: {variant.label}: {status}")
            if runners:
                self._time(runners, result)
        torch.compiler.reset()  # the next model starts with empty compile caches
        return result

    def _low_precision_skipped(self) -> str | None:
        """Why the low-precision variants are not run, or None: they are skipped where the low dtype's matrix
        products run slower than fp32's (no native support: timing them would take hours and say nothing)."""
        rates = self.rates
        low, fp32 = rates.get(self.low_precision), rates.get("fp32")
        if low is None or fp32 is None or low >= fp32:
            return None
        return (
            f"{self.low_precision} matrix products run at {low:.1f} GFLOP/s here, {fp32 / low:.0f}x slower than fp32's "
            f"{fp32:.0f} (no native {self.low_precision} on this {self.device.type}): low-precision variants are not timed"
        )

    def _prepare(self, variant: Variant, setup: Setup, outcome: VariantResult, runners: dict[str, Runner]) -> Any:
        """Build the variant and make its first and warm-up calls; record setup time and memory; return its output."""
        _release_freed_memory(self.device)
        try:
            with _PeakMemory(self.device) as memory:
                _synchronize(self.device)
                started = time.perf_counter()
                built = variant.build(setup)
                outcome.note = getattr(built, "note", None)
                runner = _in_inference_mode(built)
                output = runner()
                _synchronize(self.device)
                outcome.setup_s = time.perf_counter() - started
                for _ in range(self.warmup):
                    runner()
                _synchronize(self.device)
        except VariantSkipped as reason:
            outcome.status, outcome.reason = "skipped", str(reason)
            return None
        except Exception as error:  # a failing variant is a result, not the end of the run
            outcome.status, outcome.reason = "failed", _failure(error)
            return None
        outcome.peak_memory_mb = memory.grown_mb
        runners[variant.key] = runner
        return output

    def _time(self, runners: dict[str, Runner], result: ModelResult) -> None:
        """Interleaved rounds over the variants that built; a variant failing a call is dropped and the rounds rerun."""
        outcomes = {outcome.key: outcome for outcome in result.variants}
        while runners:
            guarded = {key: _guarded(key, run) for key, run in runners.items()}
            try:
                with ForeignLoad() as foreign:
                    samples = interleaved_samples(guarded, rounds=self.rounds, warmup=0, measure=self.measure)
            except _CallFailed as failure:
                outcomes[failure.key].status, outcomes[failure.key].reason = "failed", failure.reason
                del runners[failure.key]
                continue
            baseline = samples.get(self.variants[0].key)
            for key, seconds in samples.items():
                outcome = outcomes[key]
                outcome.samples_ms = [s * 1e3 for s in seconds]
                if baseline is not None:
                    outcome.round_ratios = [b / s if s > 0 else float("inf") for b, s in zip(baseline, seconds, strict=True)]
            result.foreign_cpu = foreign.cores
            if foreign.cores is not None and foreign.cores > FOREIGN_CPU_WARNING:
                result.warnings.append(
                    f"other processes kept {foreign.cores:.2f} cores busy on average while it was timed: "
                    "its figures are unreliable; rerun on a quiet machine"
                )
            return

    def run(self, models: Sequence[BenchModel], command: str, on_model: Callable[[BenchResult], None] | None = None) -> BenchResult:
        """Every model in turn; ``on_model`` sees the result after each model (e.g. to write files as it goes)."""
        result = self.new_result(command)
        for spec in models:
            result.models.append(self.run_model(spec))
            if on_model is not None:
                on_model(result)
        return result
