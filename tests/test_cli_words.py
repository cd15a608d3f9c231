"""The command line shows library errors in its own spelling: `--dynamic-shapes auto`, not `dynamic_shapes='auto'`."""

import argparse

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.cli import build_parser, cli_words


def command(name: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_a_call_time_size_error_names_the_command_line_s_dynamic_shapes_option() -> None:
    fast = graphopt.optimize(nn.Conv2d(3, 4, 3).eval(), (torch.randn(2, 3, 8, 8),))
    with pytest.raises(graphopt.InputMismatchError) as raised:
        fast(torch.randn(2, 3, 10, 10))  # image sizes are fixed by default
    said = cli_words(str(raised.value), command("optimize"))
    assert "dynamic_shapes" not in said and "torch.export.Dim" not in said
    assert "optimize with --dynamic-shapes {batch+sequence,batch,auto,none} (or --dynamic-shapes auto: every" in said


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("dynamic_shapes=None makes them static", "--dynamic-shapes none makes them static"),
        ("pass precision='int8' and calibration=", "pass --precision int8 and --calibration"),
    ],
)
def test_library_spellings_become_the_optimize_command_s(message: str, expected: str) -> None:
    assert cli_words(message, command("optimize")) == expected
