"""What the generation benchmark (`graphopt.bench.generate`) measured, as JSON and a markdown table.

Per variant and round: the time to the first token and the time per new token past it. A ratio is eager fp32's time
in a round over the variant's in the same round, median over the rounds (higher is faster): a burst of foreign load
slows numerator and denominator alike.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMES = ("first_token_ms", "per_token_ms")


@dataclass
class VariantRow:
    """One variant of one model: status, times per round, and how its tokens compare with eager fp32's."""

    key: str
    label: str
    role: str  # "baseline" (eager fp32), "peer" or "graphopt"
    status: str = "ok"  # "ok", "failed" or "skipped"
    reason: str | None = None  # why it failed or was skipped
    setup_s: float | None = None  # building it plus its first generation (compilers work then)
    same_tokens: float | None = None  # the fraction of its new tokens equal to eager fp32's
    notes: list[str] = field(default_factory=list)  # what it ran on (engine, precision), what tune measured
    first_token_ms: list[float] = field(default_factory=list)  # one per round: a 1-token generate()
    per_token_ms: list[float] = field(default_factory=list)  # one per round: (all new tokens - first) / (new tokens - 1)

    def median(self, times: str) -> float | None:
        """The median of ``times`` (`TIMES`), None when it was not timed."""
        samples = getattr(self, times)
        return statistics.median(samples) if samples else None


@dataclass
class ModelRows:
    """Every variant of one model, timed together."""

    name: str
    parameters: int
    variants: list[VariantRow] = field(default_factory=list)
    error: str | None = None  # the model could not be built
    foreign_cpu: float | None = None  # cores other processes kept busy while timing (None: unknown)
    warnings: list[str] = field(default_factory=list)

    def ratio(self, row: VariantRow, times: str) -> float | None:
        """eager fp32's ``times`` over ``row``'s, per round, median (None: either was not timed, or a time per new token
        came out at zero or below, as the noise of a tiny smoke run can make it)."""
        baseline = next((v for v in self.variants if v.role == "baseline"), None)
        ours, theirs = getattr(row, times), getattr(baseline, times, [])
        if not ours or len(ours) != len(theirs) or min(ours + theirs) <= 0:
            return None
        return statistics.median(b / s for b, s in zip(theirs, ours, strict=True))

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.variants:
            figures = {f"median_{times}": row.median(times) for times in TIMES} | {f"{times.removesuffix('_ms')}_vs_eager": self.ratio(row, times) for times in TIMES}
            rows.append(dataclasses.asdict(row) | figures)
        return {"name": self.name, "parameters": self.parameters, "error": self.error, "foreign_cpu": self.foreign_cpu, "warnings": self.warnings, "variants": rows}


@dataclass
class GenerationResult:
    """A whole run: where and how it was measured, and each model's rows."""

    command: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    models: list[ModelRows] = field(default_factory=list)

    def warnings(self) -> list[str]:
        load = self.machine.get("load_average_at_start")
        cores = self.machine.get("cores") or 1
        busy = [] if load is None or load[0] <= 0.5 * cores else [
            f"the machine was busy before the run (1-minute load average {load[0]:.1f} on {cores} cores): rerun on a quiet machine"
        ]  # fmt: skip
        return busy + [f"{model.name}: {warning}" for model in self.models for warning in model.warnings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command, "machine": self.machine, "settings": self.settings, "warnings": self.warnings(),
            "models": [model.to_dict() for model in self.models],
        }  # fmt: skip

    def to_markdown(self) -> str:
        machine, settings = self.machine, self.settings
        versions = ", ".join(f"{package} {machine.get(package) or 'not installed'}" for package in ("transformers", "openvino", "optimum-intel", "nncf"))
        new_tokens = settings["new_tokens"]
        lines = [
            f"Machine: {machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} torch threads; flags {', '.join(machine['cpu_flags']) or 'none listed'}); "
            f"torch {machine['torch']}, {versions}.",
            "",
            f"Command: `{self.command}`",
            "",
            f"Settings: batch 1, a {settings['prompt_length']}-token prompt, {new_tokens} new tokens, greedy; {settings['rounds']} interleaved "
            f"round(s){' on tiny 2-layer models (a smoke run: the figures mean nothing)' if settings['tiny'] else ''}. First token: a 1-token "
            f"generate() (the prefill and one choice); per new token: ({new_tokens}-token generate() - first token) / {new_tokens - 1}. "
            "vs eager fp32: eager fp32's time over the variant's in the same round, median of the rounds (higher is faster); "
            "the \"again\" copy of eager fp32 shows the run's noise floor. Same tokens: the fraction of the new tokens equal to eager fp32's.",
            "",
            *[f"> **warning:** {warning}" for warning in self.warnings()],
            "",
            "| model | variant | first token | vs eager fp32 | per new token | vs eager fp32 | same tokens | setup | note |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for model in self.models:
            if model.error is not None:
                lines.append(f"| {model.name} | — | — | — | — | — | — | — | not run: {model.error} |")
            lines += [self._row(model, row) for row in model.variants]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _row(model: ModelRows, row: VariantRow) -> str:
        note = "; ".join(row.notes)
        if row.status != "ok":
            note = f"{row.status}: {row.reason}" + (f" ({note})" if note else "")
        cells = [
            model.name, row.label, _number(row.median("first_token_ms"), ".1f", " ms"), _number(model.ratio(row, "first_token_ms"), ".2f", "x"),
            _number(row.median("per_token_ms"), ".2f", " ms"), _number(model.ratio(row, "per_token_ms"), ".2f", "x"),
            _number(row.same_tokens, ".0%"), _number(row.setup_s, ".1f", " s"), note.replace("|", "/"),
        ]  # fmt: skip
        return "| " + " | ".join(cells) + " |"


def _number(value: float | None, form: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{form}}{suffix}"


def write_outputs(result: GenerationResult, output_dir: Path) -> list[str]:
    """Write bench.json and bench.md into ``output_dir``; returns what was written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    (output_dir / "bench.md").write_text(result.to_markdown())
    return [f"written: {output_dir / 'bench.json'}, {output_dir / 'bench.md'}"]
