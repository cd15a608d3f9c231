"""Run by tests/backends/test_openvino_engine.py in a fresh process: is this thread's alternate signal stack still
mapped after OpenVINO Cores were made and freed out of order?

``python -m tests.backends.openvino_signal_stack_worker`` prints the state (``mapped``, ``disabled`` or
``unmapped``) after two OpenVINO engine results were freed first-made first, then after two ``openvino.Core``
objects, each compiling a model, were freed the same way (what a process making a Core per model does).
"""

from __future__ import annotations

import ctypes
import gc

import openvino
import torch

import graphopt

SS_DISABLE = 2


class SignalStack(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def alternate_signal_stack() -> str:
    stack = SignalStack()
    if ctypes.CDLL(None).sigaltstack(None, ctypes.byref(stack)) != 0:
        raise OSError("sigaltstack failed")
    if stack.ss_flags & SS_DISABLE or not stack.ss_sp:
        return "disabled"
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(address, 16) for address in line.split()[0].split("-"))
            if low <= stack.ss_sp and stack.ss_sp + stack.ss_size <= high:
                return "mapped"
    return "unmapped"


def main() -> None:
    model, x = torch.nn.Linear(4, 4).eval(), torch.randn(2, 4)
    first = graphopt.optimize(model, x, engine="openvino")
    second = graphopt.optimize(model, x, engine="openvino", precision="fp32")
    del first
    del second
    gc.collect()
    print(alternate_signal_stack())
    converted = openvino.convert_model(model, example_input=x)
    first_core = openvino.Core()
    first_compiled = first_core.compile_model(converted, "CPU")
    second_core = openvino.Core()
    second_compiled = second_core.compile_model(converted, "CPU")
    del first_compiled, first_core
    del second_compiled, second_core
    gc.collect()
    print(alternate_signal_stack())


if __name__ == "__main__":
    main()
