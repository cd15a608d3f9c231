"""GraphDiff: what each pass removed, added and changed; text, HTML, DOT renderings; the diff CLI."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import cli
from tests.conftest import FRONTENDS, ConvOutputReused, randomize_batch_norms


class ConvBNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))).mean((2, 3)))


def optimized(frontend: str = "fx", **options) -> graphopt.OptimizedModule:
    model = randomize_batch_norms(ConvBNNet()).eval()
    return graphopt.optimize(model, torch.randn(2, 3, 8, 8), frontend=frontend, memory_format="preserve", **options)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_fold_diff_lists_the_removed_batchnorms_and_the_changed_convs(frontend: str) -> None:
    fold = optimized(frontend).graphopt_report.diffs["fold_conv_bn"]
    batch_norm = {"fx": {"bn1", "bn2"}, "export": {"batch_norm", "batch_norm_1"}}[frontend]
    convs = {"fx": {"conv1", "conv2"}, "export": {"conv2d", "conv2d_1"}}[frontend]
    assert {n.name for n in fold.removed if n.op != "get_attr"} == batch_norm
    assert {n.name for n in fold.changed} == convs
    assert {n.name for n in fold.added if n.op != "get_attr"} == set()
    assert all("folded" in fold.rewritten[name] for name in convs)


def test_whole_pipeline_diff_and_per_pass_diffs() -> None:
    module = optimized()
    report = module.graphopt_report
    assert list(report.diffs) == [p.name for p in report.passes]
    whole = graphopt.diff(module)
    assert {n.name for n in whole.removed} == {"bn1", "bn2", "drop"}
    assert ("BatchNorm2d", 2, 0) in whole.op_counts() and ("Dropout", 1, 0) in whole.op_counts()
    json.dumps(report.to_dict())  # diffs stay out of the JSON report
    assert "diffs" not in report.to_dict()


def test_text_rendering_is_stable() -> None:
    text = optimized().graphopt_report.diffs["fold_conv_bn"].render_text()
    assert text == (
        "graphopt diff: fold_conv_bn: 8 -> 6 nodes (-2 +0 ~2)\n"
        "op counts: BatchNorm2d 2->0\n"
        "- removed bn1    call_module BatchNorm2d  [2, 4, 6, 6] float32\n"
        "- removed bn2    call_module BatchNorm2d  [2, 4, 4, 4] float32\n"
        "~ changed conv1  call_module Conv2d  [2, 4, 6, 6] float32  (folded bn1 into conv2d)\n"
        "~ changed conv2  call_module Conv2d  [2, 4, 4, 4] float32  (folded bn2 into conv2d)"
    )


def test_colour_only_when_asked() -> None:
    fold = optimized().graphopt_report.diffs["fold_conv_bn"]
    assert "\033[31m- removed" in fold.render_text(color=True)
    assert "\033[" not in str(fold)  # pytest's stdout is not a TTY


def test_skips_say_why_candidates_were_left_alone() -> None:
    module = graphopt.optimize(ConvOutputReused().eval(), torch.randn(2, 3, 6, 6), memory_format="preserve")
    fold = module.graphopt_report.diffs["fold_conv_bn"]
    assert "(no change)" in fold.render_text()
    assert "left alone:\n  bn: conv2d output has 2 users" in fold.render_text()


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_html_parses_and_is_self_contained(tmp_path: Path) -> None:
    fold = optimized().graphopt_report.diffs["fold_conv_bn"]
    path = fold.to_html(tmp_path / "diff.html")
    page = path.read_text()
    collector = _Collector()
    collector.feed(page)
    text = " ".join(collector.text)
    for name in ("bn1", "bn2", "conv1", "conv2", "folded bn1 into conv2d"):
        assert name in text
    assert "details" in collector.tags and "script" not in collector.tags
    assert not re.search(r"(src|href)=|url\((?!#)|@import", page)  # nothing fetched: the SVG namespace is only a name
    assert 'class="removed"' in page and 'class="changed"' in page
    assert '<tr class="d"><td>BatchNorm2d</td><td>2</td><td>0</td></tr>' in page  # the op counts
    assert "<summary>top level (8 rows: 2 removed, 2 changed)</summary>" in page  # the side-by-side group, summed up


def test_a_large_graph_renders() -> None:
    layers: list[nn.Module] = []
    for _ in range(105):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    model = nn.Sequential(*layers).eval()
    module = graphopt.optimize(model, torch.randn(2, 4, 8, 8), memory_format="preserve")
    whole = graphopt.diff(module)
    assert len(whole.before) > 300 and len(whole.removed) == 105 and len(whole.changed) == 105
    html_text = whole._repr_html_()
    # one side-by-side row per node of either graph (corresponding nodes share a row), and every node drawn
    assert html_text.count('<tr class="removed">') == 105 and html_text.count('<tr class="changed">') == 105
    assert html_text.count('<g class="node') >= len(whole.after) + 105 and len(whole.render_text().splitlines()) > 210
    assert whole.to_dot().count("->") > 100


def test_dot_and_svg_need_no_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fold = optimized().graphopt_report.diffs["fold_conv_bn"]
    dot = fold.to_dot()
    assert dot.startswith("digraph graphopt_diff {") and '"conv1" -> "relu";' in dot and "dashed" in dot
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot, no other program
    svg = fold.to_svg()
    assert svg.startswith("<svg") and 'data-name="bn1"' in svg and svg == fold.draw().svg


def test_diff_of_two_graphs_and_bad_arguments() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    before = torch.fx.symbolic_trace(model)
    after = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3)))
    two = graphopt.diff(before, after)
    assert [n.name for n in two.removed] == ["_1"] and two.added == []
    with pytest.raises(graphopt.GraphoptError, match="needs a module returned by graphopt.optimize"):
        graphopt.diff(model)
    with pytest.raises(graphopt.GraphoptError, match="cannot diff a int"):
        graphopt.diff(before, 3)


def test_cli_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "d.html"
    argv = ["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "fold_conv_bn", "--html", str(page)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("graphopt diff: fold_conv_bn:") and "- removed stem_bn" in out and page.is_file()
    assert '<g class="node removed" data-name="stem_bn">' in page.read_text()  # the HTML diff is drawn
    drawing = tmp_path / "d.svg"
    argv = ["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--drawing", str(drawing), "--fold", "none"]
    assert cli.main(argv) == 0 and f"drawing written to {drawing}" in capsys.readouterr().out
    assert drawing.read_text().startswith("<svg") and 'class="node folded' not in drawing.read_text()
    argv = ["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "remove_dropout", "--html", str(page)]
    assert cli.main(argv) == 0 and '<g class="node folded" data-name="/layer2">' in page.read_text()  # nothing changed there
    assert cli.main([*argv, "--expand", "layer2"]) == 0 and 'data-name="/layer2"' not in page.read_text()
    assert '<g class="node folded" data-name="/layer3">' in page.read_text()
    assert cli.main([*argv, "--fold", "none"]) == 0 and 'class="node folded' not in page.read_text()
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--expand", "layer1"]) == 2
    assert "--fold and --expand shape the drawing: add --html PATH or --drawing PATH" in capsys.readouterr().err
    argv = ["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--drawing", str(tmp_path / "d.pdf")]
    assert cli.main(argv) == 2 and "--drawing: 'd.pdf' is not a .svg, .html or .png path" in capsys.readouterr().err
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "nope"]) == 2
    assert "--pass 'nope' is not a pass" in capsys.readouterr().err
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "fold_conv_bm"]) == 2
    assert "did you mean 'fold_conv_bn'?" in capsys.readouterr().err


def test_cli_diff_of_an_opt_in_pass_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    """An opt-in pass is added to the preset for its diff; one that needs an option says which."""
    argv = ["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--memory-format", "channels_last", "--pass", "pad_channels"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("graphopt diff: pad_channels:")
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "use_low_precision"]) == 2
    assert "add --precision bf16" in capsys.readouterr().err
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "drop_conv_bias", "--mode", "inference"]) == 0
    assert cli.main(["diff", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--pass", "remove_dropout", "--mode", "training"]) == 2
    assert "add --mode inference" in capsys.readouterr().err
