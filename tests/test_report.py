"""Report.why: readable answers, and a misspelt name said to match nothing."""

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.errors import InvalidOptionError


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn1(self.conv1(image)))


@pytest.fixture(scope="module")
def report() -> graphopt.Report:
    return graphopt.optimize(ConvBnRelu().eval(), (torch.randn(2, 3, 8, 8),)).graphopt_report


def test_why_prints_one_reason_a_line_and_still_compares_as_a_list(report: graphopt.Report) -> None:
    reasons = report.why("bn1")
    assert reasons == ["fold_conv_bn: rewrote conv1: folded bn1 into conv2d"]
    assert str(reasons) == repr(reasons) == "fold_conv_bn: rewrote conv1: folded bn1 into conv2d"
    several = report.why("conv1")
    assert len(several) > 1 and str(several).splitlines() == list(several)


def test_why_of_a_misspelt_name_says_it_matched_nothing_and_suggests(report: graphopt.Report) -> None:
    with pytest.raises(InvalidOptionError, match=r"no node or module of the graph is named 'bn_1'; did you mean 'bn1'"):
        report.why("bn_1")


def test_why_of_a_known_name_no_pass_touched_says_so() -> None:
    fast = graphopt.optimize(ConvBnRelu().eval(), (torch.randn(2, 3, 8, 8),), passes=["fold_conv_bn"])
    untouched = fast.graphopt_report.why("relu")  # in the graph, and no pass looked at it
    assert untouched == [] and str(untouched) == "no pass rewrote or skipped 'relu'"
