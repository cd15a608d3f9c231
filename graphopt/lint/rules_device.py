"""Lint rules on devices, copies and parallelism (GO2xx)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from graphopt.lint.core import Edit, Facts, Match, add_keyword, call_name, calls, dataloader_calls, is_constant, keyword, loader_setting, rule


@rule(
    "GO201",
    "data-parallel",
    "nn.DataParallel: use DistributedDataParallel",
    "DataParallel runs one process that scatters inputs and gathers outputs through GPU 0 every step; "
    "DistributedDataParallel (one process per GPU) is faster even on one machine (playbook rule 18).",
    "torchrun --nproc_per_node=N train.py, with torch.distributed.init_process_group and "
    "model = DistributedDataParallel(model, device_ids=[local_rank])",
)
def data_parallel(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in calls(tree):
        if call_name(call).split(".")[-1] == "DataParallel":
            yield Match(call)


# Names a script binds to the torch module (``import torch``, ``import torch as th``).
def _torch_names(tree: ast.Module) -> set[str]:
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname for alias in node.names if alias.name == "torch" and alias.asname}
    return names


def _torch_function(call: ast.AST, torch_names: set[str]) -> str:
    """``zeros`` for ``torch.zeros(...)`` (or ``th.zeros(...)`` after ``import torch as th``); else ""."""
    module, _, function = call_name(call).rpartition(".")
    return function if module in torch_names else ""


def _text(node: ast.AST, source: str) -> str:
    return ast.get_source_segment(source, node) or ""


def _called(call: ast.Call) -> str:
    """The called function's own name: ``item`` for ``x.sum().item()``, ``len`` for ``len(x)``."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id if isinstance(call.func, ast.Name) else ""


# Calls whose result is a Python number or list: torch.tensor copies those whatever it is called as.
_PYTHON_VALUES = {"len", "int", "float", "bool", "complex", "list", "tuple", "range", "sum", "min", "max", "abs", "round", "sorted", "item", "tolist"}


@rule(
    "GO202",
    "tensor-from-data",
    "torch.tensor(x) copies x: torch.as_tensor(x) reuses its memory when it can",
    "torch.tensor always allocates and copies its argument, even when x is already a tensor (it warns "
    "then) or a NumPy array whose memory could be shared; torch.as_tensor and torch.from_numpy return a "
    "tensor on the same memory when dtype and device already match, so a batch is not copied once more "
    "on every step.",
    "torch.as_tensor(x) (dtype= and device= work too) or torch.from_numpy(array). Not fixed "
    "automatically: the result then shares memory with x, so an in-place change to one (t /= 255) "
    "changes the other, and a tensor x stays attached to its autograd graph; keep torch.tensor, or "
    "x.clone().detach(), where the code needs its own copy.",
)
def tensor_from_data(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    torch_names = _torch_names(tree)
    for call in calls(tree):
        if _torch_function(call, torch_names) != "tensor":
            continue
        data = call.args[0] if call.args else keyword(call, "data")
        if isinstance(data, ast.Call) and _called(data) in _PYTHON_VALUES:
            continue
        if isinstance(data, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
            yield Match(call)


_FACTORIES = {
    "zeros", "ones", "full", "empty", "arange", "eye", "linspace", "tensor",
    "zeros_like", "ones_like", "empty_like", "full_like",
    "rand", "randn", "randint", "rand_like", "randn_like",
}
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like"}
# Factory arguments the rewrite must not meet: a device already, an output buffer, a leaf that
# `.to()` would have turned into a non-leaf, pinned memory (CPU only), or hidden keywords.
_FACTORY_BLOCKERS = {"device", "out", "requires_grad", "pin_memory", None}


def _same_values_on_device(function: str, factory: ast.Call) -> bool:
    """Whether ``factory`` computes the same values on any device.

    Random factories draw from the device's generator, and linspace and a fractional arange
    compute their values in float on CUDA but in double on the CPU. ``arange(end)`` counts
    from 0 in steps of 1, exactly in either; so does an arange of integer literals.
    """
    if function in _RANDOM or function == "linspace":
        return False
    if function == "arange":
        only_end = len(factory.args) == 1 and not {"start", "step"} & {k.arg for k in factory.keywords}
        integers = all(isinstance(a, ast.Constant) and type(a.value) is int for a in [*factory.args, *(k.value for k in factory.keywords if k.arg in ("start", "end", "step"))])
        return only_end or integers
    return True


def _device_argument(argument: ast.expr, source: str, torch_names: set[str]) -> bool:
    """Whether ``argument`` of ``.to(argument)`` is clearly a device (not a dtype or another tensor)."""
    if isinstance(argument, ast.Constant):
        return isinstance(argument.value, str) and argument.value.startswith(("cuda", "cpu"))
    if isinstance(argument, ast.Call):
        return _torch_function(argument, torch_names) == "device"
    text = _text(argument, source).lower()
    return isinstance(argument, (ast.Name, ast.Attribute)) and "dtype" not in text and any(word in text for word in ("device", "cuda", "cpu"))


@rule(
    "GO203",
    "create-then-move",
    "tensor created on the CPU, then copied to the device",
    "The factory allocates and fills the tensor in host memory, then .to()/.cuda() allocates it again on "
    "the device and copies it over, a synchronous host-to-device transfer; created on the device, it is "
    "one allocation and a fill by a kernel.",
    "Pass the device to the factory: torch.zeros(3, 4, device=device) instead of "
    "torch.zeros(3, 4).to(device). --fix does this for .cuda() and .to(<device>) after a factory without "
    "device=, out=, requires_grad= or pin_memory=. It leaves to you the factories whose values would change: "
    "random ones (rand, randn, randint, rand_like, randn_like: the device's generator draws other numbers) "
    "and linspace or a fractional arange (computed in float on CUDA, in double on the CPU).",
)
def create_then_move(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    torch_names = _torch_names(tree)
    for call in calls(tree):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr in ("to", "cuda") and isinstance(call.func.value, ast.Call)):
            continue
        factory = call.func.value
        function = _torch_function(factory, torch_names)
        if function not in _FACTORIES:
            continue
        moved = "..." if call.args or call.keywords else ""
        message = f"{_text(factory.func, facts.source)}(...).{call.func.attr}({moved}) creates the tensor on the CPU, then copies it"
        device = None
        if call.func.attr == "cuda" and not call.args and not call.keywords:
            device = '"cuda"'
        elif call.func.attr == "to" and len(call.args) == 1 and not call.keywords and _device_argument(call.args[0], facts.source, torch_names):
            device = _text(call.args[0], facts.source)
        edit = None
        if device and _same_values_on_device(function, factory) and not any(k.arg in _FACTORY_BLOCKERS for k in factory.keywords):
            # replace ").to(device)" by ", device=device)": the factory's own text is left alone
            inserted = add_keyword(factory, f"device={device}", facts.source)
            if inserted is not None:
                end_line, end_col = call.end_lineno or call.lineno, call.end_col_offset or call.col_offset
                edit = Edit(inserted.line, inserted.col, end_line, end_col, inserted.replacement + ")")
        yield Match(call, message, edit)


_MODEL_WORDS = ("model", "net", "module")


def _blocking_copy(call: ast.Call, source: str, torch_names: set[str]) -> bool:
    """Whether ``call`` is ``x.to(<device>)`` / ``x.cuda()`` without non_blocking=True, and may be a host-to-device copy."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr in ("to", "cuda")) or any(k.arg is None for k in call.keywords):
        return False
    if is_constant(keyword(call, "non_blocking"), True):
        return False
    receiver = call.func.value
    last = receiver.attr if isinstance(receiver, ast.Attribute) else receiver.id if isinstance(receiver, ast.Name) else ""
    if any(word in last.lower() for word in _MODEL_WORDS):  # moving a model: not a batch copy
        return False
    if call.func.attr == "cuda":
        return len(call.args) <= 1
    if len(call.args) > 2 or (len(call.args) == 2 and isinstance(call.args[1], ast.Constant)):
        return False  # .to(device, dtype, non_blocking) / .to(tensor, non_blocking): positional non_blocking
    target = call.args[0] if call.args else keyword(call, "device")
    if target is None:
        return False
    if isinstance(target, ast.Constant):
        return isinstance(target.value, str) and target.value.startswith("cuda")
    text = _text(target, source).lower()
    # a dtype is not a copy; a device-to-host copy must stay blocking for the host to read it
    return not ("dtype" in text or "cpu" in text or (isinstance(target, ast.Attribute) and call_name(target).rpartition(".")[0] in torch_names))


@rule(
    "GO204",
    "blocking-copy",
    "batch copied to the device without non_blocking=True",
    "The DataLoader pins its batches (pin_memory=True), so a copy with non_blocking=True is queued on the "
    "CUDA stream and returns at once: the host goes on to launch the forward pass while the batch "
    "transfers. Without it the host waits for every copy to finish before it queues more work.",
    "x = x.to(device, non_blocking=True) for each tensor of the batch. --fix adds it to copies of plain "
    "names and attributes (images.to(device), batch.x.cuda()); never make a device-to-host copy "
    "non-blocking when the host then reads the result without torch.cuda.synchronize().",
)
def blocking_copy(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    if not any(is_constant(loader_setting(call, "pin_memory"), True) for call in dataloader_calls(tree)):
        return
    torch_names = _torch_names(tree)
    seen: set[int] = set()
    for loop in ast.walk(tree):
        if not (isinstance(loop, (ast.For, ast.AsyncFor)) and "loader" in _text(loop.iter, facts.source).lower()):
            continue
        for statement in loop.body:
            for call in calls(statement):
                if id(call) in seen or not _blocking_copy(call, facts.source, torch_names):
                    continue
                seen.add(id(call))
                edit = None
                if isinstance(call.func.value, (ast.Name, ast.Attribute)) and keyword(call, "non_blocking") is None:
                    edit = add_keyword(call, "non_blocking=True", facts.source)
                yield Match(call, edit=edit)
