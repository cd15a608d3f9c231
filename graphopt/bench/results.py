"""What a benchmark run measured, and its renderings: JSON, a markdown table and a PNG plot.

Ratios are computed per round (eager fp32's time in that round / the variant's time in
the same round) and the median of those is reported: a round is a few consecutive
calls, so a burst of foreign load slows numerator and denominator alike.

Precision classes: a variant whose output error against eager fp32 is at most
`EXACT_CLASS_ERROR` is in the ``exact`` class (fp32 arithmetic in another order), any
other in the ``low`` class (bf16/fp16 somewhere). Each class is judged on its own: its
best peer against graphopt's public default for it (the default call; ``precision=``),
and each variant's achieved FLOP/s against the machine's matrix-multiply rate in the
class's precision (the roofline fraction).

Implausible figures are flagged, never hidden: a CPU fp32 matrix-multiply rate below
`PLAUSIBLE_CPU_FP32_GFLOPS_PER_THREAD` per torch thread (what a loaded machine measures),
and a roofline fraction over 100% (faster than the machine's own matrix products). Each
carries its reason in the JSON (``implausible``) and the markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.precision import DEFAULT_INT8_ACCURACY
from graphopt.timing import FOREIGN_LOAD_LIMIT

FOREIGN_CPU_WARNING = FOREIGN_LOAD_LIMIT  # cores kept busy by other processes while timing, on average: as optimize's measurements
EXACT_CLASS_ERROR = 1e-4  # a larger max error (relative to the output's scale) puts a variant in the low-precision class
CLASSES = ("exact", "low", "int8")  # int8: the variants that quantize to int8, whatever their error
# Any x86-64 or Arm server core of the last decade multiplies fp32 matrices at 10+ GFLOP/s per thread, even on
# --quick's small product; a measured rate below this means other processes held the cores while it was measured.
PLAUSIBLE_CPU_FP32_GFLOPS_PER_THREAD = 4.0
LOADED_MACHINE = "usually the machine was loaded while it was measured: rerun on a quiet machine"


def implausible_rate(machine: dict[str, Any]) -> str | None:
    """Why the machine's measured fp32 matrix-multiply rate cannot be right (CPU only), or None when it is plausible."""
    fp32 = (machine.get("matmul_gflops") or {}).get("fp32")
    if machine.get("device") != "cpu" or fp32 is None:
        return None
    threads = machine.get("torch_threads") or 1
    floor = PLAUSIBLE_CPU_FP32_GFLOPS_PER_THREAD * threads
    if fp32 >= floor:
        return None
    return (
        f"the fp32 matrix-multiply rate of {fp32:.1f} GFLOP/s on {threads} torch thread(s) is far below the {floor:.0f} "
        f"GFLOP/s any current CPU reaches, so every roofline fraction is inflated; {LOADED_MACHINE}"
    )


def implausible_roofline(fraction: float | None) -> str | None:
    """Why a roofline fraction cannot be right (over 100%: faster than the machine's own matrix products), or None."""
    if fraction is None or fraction <= 1.0:
        return None
    return (
        f"roofline {fraction:.0%} is over 100%: faster than the machine's measured matrix-multiply rate, so that rate "
        f"was too low; {LOADED_MACHINE}"
    )


@dataclass
class VariantResult:
    """One variant of one model: status, timings and numerics."""

    key: str
    label: str
    role: str  # "baseline", "graphopt", "peer" or "noise" (see `graphopt.bench.variants`)
    status: str = "ok"  # "ok", "failed" or "skipped"
    reason: str | None = None  # why it failed or was skipped
    setup_s: float | None = None  # building it (optimize, compile, export) plus its first call
    peak_memory_mb: float | None = None  # see BenchResult.memory_method
    max_error: float | None = None  # max |out - eager fp32| / max |eager fp32| over all outputs
    samples_ms: list[float] = field(default_factory=list)  # one per round
    round_ratios: list[float] = field(default_factory=list)  # eager fp32 / this variant, per round
    class_default: str | None = None  # the precision class this variant is graphopt's public default for
    int8: bool = False  # it quantizes to int8: its class is "int8"
    direct: str | None = None  # the peer running the same engine directly (a "noise" variant: the peer it copies)
    note: str | None = None  # what the builder says of it (tune=True: its choice, and tune's own timing of it)

    @property
    def precision_class(self) -> str | None:
        """``int8`` for int8 variants, else ``exact`` or ``low`` from the measured error (None: no output to measure)."""
        if self.max_error is None:
            return None
        if self.int8:
            return "int8"
        return "exact" if self.max_error <= EXACT_CLASS_ERROR else "low"

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.samples_ms) if self.samples_ms else None

    @property
    def ratio(self) -> float | None:
        """Speed-up over eager fp32: the median of the per-round ratios (higher is faster)."""
        return statistics.median(self.round_ratios) if self.round_ratios else None

    def gflops(self, flops: float | None) -> float | None:
        """Achieved GFLOP/s at the median latency, for a model of ``flops`` per call."""
        median = self.median_ms
        return None if flops is None or not median else flops / (median / 1e3) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self), "median_ms": self.median_ms, "ratio_vs_eager": self.ratio, "precision_class": self.precision_class,
        }  # fmt: skip


@dataclass
class ModelResult:
    """Every variant of one model, timed together."""

    name: str
    input_shapes: list[list[int]]
    flops: float | None = None  # floating-point operations of one eager call (None: not counted)
    variants: list[VariantResult] = field(default_factory=list)
    error: str | None = None  # the model could not be built or run eagerly
    foreign_cpu: float | None = None  # cores other processes kept busy while timing (None: unknown)
    warnings: list[str] = field(default_factory=list)

    def timed(self, role: str, precision_class: str | None = None) -> list[VariantResult]:
        """The variants of ``role`` that were timed (of ``precision_class`` only, when given)."""
        return [v for v in self.variants if v.role == role and v.samples_ms and precision_class in (None, v.precision_class)]

    def fastest(self, role: str, precision_class: str | None = None) -> VariantResult | None:
        candidates = self.timed(role, precision_class)
        return min(candidates, key=lambda v: v.median_ms or 0.0) if candidates else None

    def class_default(self, precision_class: str) -> VariantResult | None:
        """graphopt's public default for ``precision_class``, when it ran (and landed in that class)."""
        return next((v for v in self.timed("graphopt", precision_class) if v.class_default == precision_class), None)

    def graphopt_vs(self, peer: VariantResult | None, ours: VariantResult | None = None) -> float | None:
        """``peer``'s time / ``ours``'s (default: the fastest graphopt variant), median over rounds (>1: graphopt wins)."""
        ours = ours or self.fastest("graphopt")
        if peer is None or ours is None or not peer.samples_ms:
            return None
        return statistics.median(p / g for p, g in zip(peer.samples_ms, ours.samples_ms, strict=True))

    @property
    def graphopt_vs_best_peer(self) -> float | None:
        """Fastest peer's time / fastest graphopt variant's time, median over rounds (>1: graphopt wins)."""
        return self.graphopt_vs(self.fastest("peer"))

    def graphopt_vs_each_peer(self) -> dict[str, float | None]:
        """Per peer key: its time / the fastest graphopt variant's time (None: the peer did not run)."""
        return {v.key: self.graphopt_vs(v) for v in self.variants if v.role == "peer"}

    def engine_pairs(self) -> list[tuple[VariantResult, VariantResult, float]]:
        """Each timed graphopt variant on an engine with its peer running that engine directly, and the peer's time /
        graphopt's (> 1: graphopt is faster); the "noise" copy with the peer it copies (their ratio: the noise floor)."""
        timed = {v.key: v for v in self.variants if v.samples_ms}
        return [
            (v, timed[v.direct], ratio)
            for v in timed.values()
            if v.direct in timed and (ratio := self.graphopt_vs(timed[v.direct], v)) is not None
        ]

    @property
    def noise_floor(self) -> float | None:
        """How far apart two identical copies of one peer timed: the median of their per-round ratios, for the first
        noise copy that ran in variant order (onnxruntime's, else OpenVINO f32's; None: none ran)."""
        return next((ratio for ours, _, ratio in self.engine_pairs() if ours.role == "noise"), None)

    def roofline(self, variant: VariantResult | None, rates: dict[str, float], low_precision: str) -> float | None:
        """``variant``'s achieved FLOP/s over the machine's matrix-multiply rate in its class's precision."""
        if variant is None or variant.precision_class is None:
            return None
        rate = rates.get({"exact": "fp32", "int8": "int8"}.get(variant.precision_class, low_precision))
        gflops = variant.gflops(self.flops)
        return None if gflops is None or not rate else gflops / rate

    def class_summary(self, precision_class: str, rates: dict[str, float], low_precision: str) -> dict[str, Any] | None:
        """One precision class: its best peer, graphopt's default and fastest variant, their ratios and roofline fractions."""
        peer, default, fastest = self.fastest("peer", precision_class), self.class_default(precision_class), self.fastest("graphopt", precision_class)
        if peer is None and fastest is None:
            return None
        return {
            "best_peer": peer.key if peer else None,
            "graphopt_default": default.key if default else None,
            "default_vs_best_peer": self.graphopt_vs(peer, default) if default else None,
            "fastest_graphopt": fastest.key if fastest else None,
            "fastest_vs_best_peer": self.graphopt_vs(peer, fastest) if fastest else None,
            "roofline_best_peer": self.roofline(peer, rates, low_precision),
            "roofline_default": self.roofline(default, rates, low_precision),
            "roofline_fastest": self.roofline(fastest, rates, low_precision),
        }

    def to_dict(self, rates: dict[str, float] | None = None, low_precision: str = "bf16") -> dict[str, Any]:
        peer, ours = self.fastest("peer"), self.fastest("graphopt")
        return {
            "name": self.name,
            "input_shapes": self.input_shapes,
            "flops": self.flops,
            "classes": {c: self.class_summary(c, rates or {}, low_precision) for c in CLASSES},
            "error": self.error,
            "foreign_cpu": self.foreign_cpu,
            "warnings": self.warnings,
            "best_peer": peer.key if peer else None,
            "best_graphopt": ours.key if ours else None,
            "graphopt_vs_best_peer": self.graphopt_vs_best_peer,
            "graphopt_vs_each_peer": self.graphopt_vs_each_peer(),
            "noise_floor": self.noise_floor,
            "direct_vs_through_graphopt": {ours.key: {"direct": direct.key, "ratio": ratio} for ours, direct, ratio in self.engine_pairs() if ours.role != "noise"},
            "variants": [self._variant_dict(v, rates or {}, low_precision) for v in self.variants],
        }

    def _variant_dict(self, variant: VariantResult, rates: dict[str, float], low_precision: str) -> dict[str, Any]:
        roofline = self.roofline(variant, rates, low_precision)
        return {
            **variant.to_dict(), "gflops": variant.gflops(self.flops), "roofline_fraction": roofline, "implausible": implausible_roofline(roofline),
        }  # fmt: skip

    def implausible(self, rates: dict[str, float], low_precision: str) -> list[str]:
        """The implausible figures of this model's variants, one line each with the reason."""
        problems = ((v, implausible_roofline(self.roofline(v, rates, low_precision))) for v in self.variants)
        return [f"{self.name}: {v.label}: {problem}" for v, problem in problems if problem]


@dataclass
class BenchResult:
    """A whole run: where and how it was measured, and each model's results."""

    command: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    memory_method: str
    models: list[ModelResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def all_warnings(self) -> list[str]:
        return self.warnings + [f"{model.name}: {warning}" for model in self.models for warning in model.warnings]

    def implausible(self) -> list[str]:
        """Every implausible figure of the run (the machine's rate, then each variant's roofline), with the reason."""
        rate = implausible_rate(self.machine)
        return ([f"matrix-multiply rate: {rate}"] if rate else []) + [
            line for model in self.models for line in model.implausible(self.rates, self.low_precision)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "machine": self.machine,
            "settings": self.settings,
            "memory_method": self.memory_method,
            "warnings": self.all_warnings(),
            "implausible": self.implausible(),
            "models": [model.to_dict(self.rates, self.low_precision) for model in self.models],
        }

    @property
    def rates(self) -> dict[str, float]:
        """The machine's measured matrix-multiply rate per precision, in GFLOP/s."""
        return dict(self.machine.get("matmul_gflops") or {})

    @property
    def low_precision(self) -> str:
        return str(self.settings.get("low_precision", "bf16"))


def _number(value: float | None, form: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{form}}{suffix}"


def to_markdown(result: BenchResult) -> str:
    """The run as markdown: machine, command, warnings, a summary of ratios, one table per model."""
    machine = result.machine
    lines = [
        f"Machine: {machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} torch threads), "
        f"device {machine['device']}; torch {machine['torch']}, onnxruntime {machine['onnxruntime']}.",
        "",
        f"Command: `{result.command}`",
        "",
        f"Settings: batch as given per model, {result.settings['rounds']} interleaved rounds after "
        f"{result.settings['warmup']} warm-up call(s); ratio = eager fp32 / variant, median of per-round ratios "
        "(higher is faster).",
        "",
    ]
    rates = result.rates
    if rates:
        measured = ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in rates.items())
        size = machine.get("matmul_size")
        flag = " (implausible: see below)" if implausible_rate(machine) else ""
        lines += [f"Matrix-multiply rate on these threads ({size}x{size} torch.mm): {measured}{flag}.", ""]
    lines += [f"> **warning:** {warning}" for warning in result.all_warnings()]
    lines += [f"> **implausible:** {problem}" for problem in result.implausible()]
    summary = [model for model in result.models if model.error is None]
    if summary:
        lines += ["", "| model | best peer | best graphopt | graphopt vs best peer | noise floor (a peer against its copy) |", "|---|---|---|---|---|"]
        for model in summary:
            peer, ours = model.fastest("peer"), model.fastest("graphopt")
            lines.append(
                f"| {model.name} | {_best(peer)} | {_best(ours)} | {_number(model.graphopt_vs_best_peer, '.2f', 'x')} | "
                f"{_number(model.noise_floor, '.2f', 'x')} |"
            )
    lines += _class_table(summary, rates, result.low_precision)
    lines += _each_peer_table(summary)
    lines += _engine_pairs_table(summary)
    for model in result.models:
        shapes = ", ".join("x".join(map(str, shape)) for shape in model.input_shapes)
        lines += ["", f"### {model.name} (input {shapes})", ""]
        if model.error is not None:
            lines.append(f"not run: {model.error}")
            continue
        lines += [
            "| variant | median latency | vs eager fp32 | optimize/compile (first call incl.) | peak memory | max error | class | GFLOP/s (roofline) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in model.variants:
            if v.status != "ok":
                lines.append(f"| {v.label} | {v.status}: {v.reason} | | | | | | |")
                continue
            lines.append(
                f"| {v.label}{f' ({v.note})' if v.note else ''} | {_number(v.median_ms, '.2f', ' ms')} | {_number(v.ratio, '.2f', 'x')} | "
                f"{_number(v.setup_s, '.2f', ' s')} | {_number(v.peak_memory_mb, '.1f', ' MiB')} | {_number(v.max_error, '.1e')} | "
                f"{v.precision_class or '—'} | {_number(v.gflops(model.flops), '.1f')} ({_roofline(model.roofline(v, rates, result.low_precision))}) |"
            )
    lines += ["", f"Peak memory: {result.memory_method}.", ""]
    return "\n".join(lines)


def _class_table(models: list[ModelResult], rates: dict[str, float], low_precision: str) -> list[str]:
    """Per model and precision class: best peer vs graphopt's public default and its fastest variant, with roofline fractions."""
    rows = []
    for model in models:
        for precision_class in CLASSES:
            summary = model.class_summary(precision_class, rates, low_precision)
            if summary is None:
                continue
            variants = {v.key: v for v in model.variants}

            def label(key: str | None, precision_class: str = precision_class) -> str:
                if key is None:
                    return "—"
                error = variants[key].max_error
                if precision_class == "int8" and error is not None and error > DEFAULT_INT8_ACCURACY:  # fast, but not within int8's budget
                    return f"{variants[key].label} (error {error:.1e}: over the {DEFAULT_INT8_ACCURACY:g} budget)"
                return variants[key].label

            roofline = " / ".join(_roofline(summary[f"roofline_{which}"]) for which in ("default", "fastest", "best_peer"))
            rows.append(
                f"| {model.name} | {precision_class} | {label(summary['best_peer'])} | {label(summary['graphopt_default'])} | "
                f"{_number(summary['default_vs_best_peer'], '.2f', 'x')} | {label(summary['fastest_graphopt'])} | "
                f"{_number(summary['fastest_vs_best_peer'], '.2f', 'x')} | {roofline} |"
            )
    if not rows:
        return []
    return [
        "",
        f"Per precision class (exact: max error <= {EXACT_CLASS_ERROR:.0e} of the output's scale; low: above; int8: quantized to int8, "
        f"flagged where its error is over graphopt's default int8 budget, {DEFAULT_INT8_ACCURACY:g}), best peer time / "
        "graphopt time, median of per-round ratios (> 1: graphopt is faster); roofline: achieved FLOP/s / the matrix-multiply "
        "rate of the class's precision, for graphopt's default / graphopt's fastest / the best peer:",
        "",
        "| model | class | best peer | graphopt default | default vs best peer | fastest graphopt | fastest vs best peer | roofline |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _each_peer_table(models: list[ModelResult]) -> list[str]:
    """Per model, the fastest graphopt variant against every peer: peer time / graphopt time, per-round medians."""
    peers = list(dict.fromkeys((v.key, v.label) for model in models for v in model.variants if v.role == "peer"))
    if not peers or not any(model.fastest("graphopt") for model in models):
        return []
    lines = [
        "", "Fastest graphopt variant vs each peer (peer time / graphopt time, median of per-round ratios; > 1: graphopt is faster):", "",
        "| model | fastest graphopt | " + " | ".join(label for _, label in peers) + " |",
        "|---|---|" + "---|" * len(peers),
    ]
    for model in models:
        ratios = model.graphopt_vs_each_peer()
        ours = model.fastest("graphopt")
        cells = [_number(ratios.get(key), ".2f", "x") for key, _ in peers]
        lines.append(f"| {model.name} | {ours.label if ours else '—'} | " + " | ".join(cells) + " |")
    return lines


def _engine_pairs_table(models: list[ModelResult]) -> list[str]:
    """Per model, each engine used directly against the same engine through graphopt, beside the run's noise floor."""
    rows = [
        f"| {model.name} | {direct.label} | {ours.label} | {ratio:.2f}x | {_number(model.noise_floor, '.2f', 'x')} |"
        for model in models
        for ours, direct, ratio in model.engine_pairs()
        if ours.role != "noise"
    ]
    if not rows:
        return []
    return [
        "",
        "The same engine used directly and through graphopt (direct time / graphopt time, median of per-round ratios; "
        "> 1: graphopt is faster), and the run's noise floor (onnxruntime on the plain export against an identical copy "
        "of itself, or OpenVINO f32's where it did not run):",
        "",
        "| model | engine used directly | through graphopt | direct vs graphopt | noise floor |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _roofline(fraction: float | None) -> str:
    """A roofline fraction as a percentage, marked when it is implausible (the reason is listed above the tables)."""
    return _number(fraction, ".0%") + (" implausible" if implausible_roofline(fraction) else "")


def _best(variant: VariantResult | None) -> str:
    return "—" if variant is None else f"{variant.label} ({_number(variant.ratio, '.2f', 'x')})"


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")


# Tableau's ten qualitative colours (matplotlib's "tab:" names), told apart in print and by most colour-blind readers.
BAR_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
BAR_HATCHES = ("/", ".", "x", "\\", "o", "+", "-", "|", "*")  # one character each: repeated, it only gets denser


def bar_styles(count: int) -> list[tuple[str, str]]:
    """A distinct (colour, hatch) pair for each of ``count`` bars: the ten colours plain, then again with each hatch
    (drawn twice for a visible density), then with denser hatches: no two bars look alike however many there are."""
    styles = []
    for index in range(count):
        shade, colour = divmod(index, len(BAR_COLOURS))
        if shade == 0:
            styles.append((BAR_COLOURS[colour], ""))
            continue
        density, hatch = divmod(shade - 1, len(BAR_HATCHES))
        styles.append((BAR_COLOURS[colour], BAR_HATCHES[hatch] * (density + 2)))
    return styles


def write_plot(result: BenchResult, path: Path) -> str | None:
    """A bar chart of each variant's ratio to eager fp32, per model; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'graphopt[bench]')"
    models = [model for model in result.models if model.error is None]
    labels = list(dict.fromkeys(v.label for model in models for v in model.variants))
    if not models or not labels:
        return "no plot: no model was timed"
    figure, axes = plt.subplots(figsize=(max(9.0, 4.0 + 0.3 * len(labels) * len(models)), 4.8))
    width = 0.8 / len(labels)
    for index, (label, (colour, hatch)) in enumerate(zip(labels, bar_styles(len(labels)), strict=True)):
        ratios = []
        for model in models:
            found = next((v for v in model.variants if v.label == label), None)
            ratios.append(found.ratio if found is not None and found.ratio is not None else float("nan"))  # no bar
        positions = [m + (index - (len(labels) - 1) / 2) * width for m in range(len(models))]
        axes.bar(positions, ratios, width, label=label, color=colour, hatch=hatch, edgecolor="white", linewidth=0.5)
    axes.set_yscale("log")  # ratios: 2x faster and 2x slower lie equally far from 1
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(models)), [model.name for model in models])
    axes.set_ylabel("speed-up over eager fp32 (median of per-round ratios)")
    axes.set_title(f"graphopt bench on {result.machine['device']}: {result.machine['cpu']}", fontsize=9)
    axes.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
