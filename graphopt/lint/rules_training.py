"""Lint rules on the training loop (GO3xx)."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator

from graphopt.lint.core import Facts, Match, call_name, calls, constant_int, dataloader_calls, is_constant, keyword, loader_setting, replace_node, rule


@rule(
    "GO301",
    "zero-grad-to-zero",
    "zero_grad(set_to_none=False) writes zeros into every gradient",
    "Setting gradients to None instead skips a memset per parameter and lets the next backward write "
    "instead of accumulate (the default since PyTorch 2.0).",
    "zero_grad() or zero_grad(set_to_none=True)",
)
def zero_grad_to_zero(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in calls(tree):
        value = keyword(call, "set_to_none")
        if call_name(call).endswith("zero_grad") and is_constant(value, False):
            assert value is not None
            yield Match(call, edit=replace_node(value, "True"))


# --- shared helpers -------------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
_BUILTINS = frozenset(dir(builtins))
_HOST_SYNCS = ("item", "cpu", "tolist", "numpy")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> Iterator[ast.AST]:
    while node in parents:
        node = parents[node]
        yield node


def _scope(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST:
    """The innermost function, lambda, class or module holding ``node``."""
    return next(a for a in _ancestors(node, parents) if isinstance(a, _SCOPES))


def _position(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def _has_modulo(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(node))


def _modulo_guarded(node: ast.AST, stop: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` runs under an ``if`` whose test has a ``%`` (``if step % N == 0``), below ``stop``.

    The test itself runs every time, so a node inside the test is not guarded by it.
    """
    child = node
    for ancestor in _ancestors(node, parents):
        if ancestor is stop:
            return False
        if isinstance(ancestor, ast.If) and child is not ancestor.test and _has_modulo(ancestor.test):
            return True
        child = ancestor
    return False


def _innermost_training_loops(facts: Facts) -> list[ast.AST]:
    """The training loops holding no other training loop: the per-step loops, not the per-epoch ones."""
    loops = facts.training_loops
    inner = []
    for loop in loops:
        below = set(ast.walk(loop)) - {loop}
        if not any(other in below for other in loops):
            inner.append(loop)
    return inner


def _snippet(node: ast.AST, limit: int = 40) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_method_call(call: ast.Call, names: tuple[str, ...]) -> bool:
    return isinstance(call.func, ast.Attribute) and call.func.attr in names


# --- GO302 ----------------------------------------------------------------------------------

_NO_GRAD = ("no_grad", "inference_mode")
_EVAL_WORDS = ("eval", "valid", "test")


def _disables_grad(expr: ast.expr) -> bool:
    """``torch.no_grad()``, ``torch.inference_mode()`` (not ``(False)``), ``torch.set_grad_enabled(False)``, or a bare decorator."""
    name = call_name(expr).split(".")[-1]
    if not isinstance(expr, ast.Call):
        return name in _NO_GRAD  # @torch.no_grad / @torch.inference_mode used without parentheses
    mode = expr.args[0] if expr.args else keyword(expr, "mode")
    if name == "no_grad":
        return True
    if name == "inference_mode":
        return not is_constant(mode, False)
    if name == "set_grad_enabled":
        return is_constant(mode, False)
    return False


def _name_words(name: str) -> list[str]:
    """``run_validation`` -> [run, validation]; ``evalEpoch`` -> [eval, epoch]."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def _eval_named(name: str) -> bool:
    """Whether a function or variable name says evaluation: ``evaluate``, ``run_validation``, ``val_loader``, ``testEpoch``."""
    return any(word.startswith(_EVAL_WORDS) or word == "val" for word in _name_words(name))


def _mode_call(call: ast.Call) -> str | None:
    """"eval" for ``x.eval()`` / ``x.train(False)``, "train" for ``x.train()`` / ``x.train(True)``, else None."""
    if not isinstance(call.func, ast.Attribute):
        return None
    if call.func.attr == "eval" and not call.args and not call.keywords:
        return "eval"
    if call.func.attr == "train":
        mode = call.args[0] if call.args else keyword(call, "mode")
        if mode is None or is_constant(mode, True):
            return "train"
        if is_constant(mode, False):
            return "eval"
    return None


def _model_like_call(call: ast.Call, model_names: set[str]) -> bool:
    """A call that may run a model: ``model(x)``, ``self.net(x)``, ``net.forward(x)``, ``evaluate_batch(x)``.

    Builtins (``print``, ``len``) and method calls on other objects (``writer.add_scalar``,
    ``metrics.update``) do not count.
    """
    name = call_name(call)
    if isinstance(call.func, ast.Name):
        return name not in _BUILTINS
    parts = name.split(".")
    return bool(name) and (name in model_names or parts[-1] == "forward" or (len(parts) == 2 and parts[0] == "self"))


@rule(
    "GO302",
    "eval-without-no-grad",
    "evaluation loop runs with autograd on: wrap it in torch.inference_mode()",
    "Outside torch.no_grad()/torch.inference_mode(), every forward pass records the autograd graph and keeps "
    "each layer's activations alive for a backward pass that never comes: evaluation runs slower and needs "
    "several times the memory (which also caps the evaluation batch size). model.eval() does not turn "
    "autograd off; it only switches dropout and batch norm to inference behaviour.",
    "Wrap the loop in `with torch.inference_mode():` (or `torch.no_grad()` if the outputs are later used in "
    "autograd), or decorate the evaluation function with `@torch.inference_mode()`.",
)
def eval_without_no_grad(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    parents = _parents(tree)
    mode_calls = [(call, mode) for call in calls(tree) if (mode := _mode_call(call))]
    model_names = {call_name(call.func.value) for call, _ in mode_calls if isinstance(call.func, ast.Attribute)} - {""}
    flagged: set[ast.AST] = set()
    loops = sorted((n for n in ast.walk(tree) if isinstance(n, ast.For)), key=_position)
    for loop in loops:
        if any(a in flagged for a in _ancestors(loop, parents)):
            continue  # an enclosing loop is reported already: one `with` around it covers this one
        body = [n for stmt in loop.body for n in ast.walk(stmt)]
        body_calls = [n for n in body if isinstance(n, ast.Call)]
        if any(_is_method_call(c, ("backward",)) for c in body_calls):  # also scaler.scale(loss).backward()
            continue
        if not any(_model_like_call(c, model_names) for c in body_calls):
            continue
        if any(isinstance(n, (ast.With, ast.AsyncWith)) and any(_disables_grad(i.context_expr) for i in n.items) for n in body):
            continue  # the model calls run under no_grad inside the loop
        enclosing = list(_ancestors(loop, parents))
        if any(isinstance(a, (ast.With, ast.AsyncWith)) and any(_disables_grad(i.context_expr) for i in a.items) for a in enclosing):
            continue
        if any(isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_disables_grad(d) for d in a.decorator_list) for a in enclosing):
            continue
        scope = _scope(loop, parents)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _eval_named(scope.name):
            reason = f"in {scope.name}()"
        else:
            before = [(call, mode) for call, mode in mode_calls if _scope(call, parents) is scope and _position(call) < _position(loop)]
            if not before or max(before, key=lambda item: _position(item[0]))[1] != "eval":
                continue
            last = max((call for call, _ in before), key=_position)
            reason = f"after {_snippet(last)} (line {last.lineno})"
        flagged.add(loop)
        yield Match(loop, f"evaluation loop {reason} runs with autograd on: wrap it in torch.inference_mode()")


# --- GO303 ----------------------------------------------------------------------------------

_TENSOR_PRESERVING_BUILTINS = frozenset({"sum", "min", "max", "abs", "round"})  # sum(losses) is a tensor
_NOT_TENSOR_CALLS = frozenset({*_BUILTINS, "item", "tolist", "cpu", "numpy", "size", "dim", "numel", "time", "perf_counter", "monotonic"})
_NOT_TENSOR_MODULES = frozenset({"time", "math", "os", "sys", "random", "np", "numpy", "json", "logging", "datetime", "re"})
_NOT_TENSOR_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "grad_fn", "layout"})


def _tensor_like(expr: ast.AST, tensors: set[str]) -> bool:
    """Whether ``expr`` may evaluate to a tensor, given the names known to hold tensors (a heuristic)."""
    if isinstance(expr, ast.Name):
        return expr.id in tensors
    if isinstance(expr, ast.Attribute):
        return expr.attr not in _NOT_TENSOR_ATTRIBUTES and _tensor_like(expr.value, tensors)
    if isinstance(expr, ast.Subscript):
        return _tensor_like(expr.value, tensors)
    if isinstance(expr, ast.BinOp):
        return _tensor_like(expr.left, tensors) or _tensor_like(expr.right, tensors)
    if isinstance(expr, ast.UnaryOp):
        return _tensor_like(expr.operand, tensors)
    if isinstance(expr, ast.JoinedStr):
        return any(_tensor_like(v.value, tensors) for v in expr.values if isinstance(v, ast.FormattedValue))
    if isinstance(expr, (ast.Tuple, ast.List)):
        return any(_tensor_like(e, tensors) for e in expr.elts)
    if isinstance(expr, ast.Call):
        name = call_name(expr)
        if (isinstance(expr.func, ast.Attribute) and expr.func.attr == "format") or name in _TENSOR_PRESERVING_BUILTINS:
            return any(_tensor_like(a, tensors) for a in [*expr.args, *(k.value for k in expr.keywords)])  # "{}".format(loss)
        return name.split(".")[-1] not in _NOT_TENSOR_CALLS and name.split(".")[0] not in _NOT_TENSOR_MODULES
    return False


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _tensor_names(loop: ast.AST) -> set[str]:
    """Names the loop binds to values that may be tensors: batches it iterates over, results of calls, sums of those."""
    tensors: set[str] = set()
    for _ in range(3):  # a few rounds let ``total += loss`` follow ``loss = criterion(...)``
        for node in ast.walk(loop):
            if isinstance(node, ast.For):
                iterated = node.iter
                if isinstance(iterated, ast.Call) and call_name(iterated) == "range":
                    continue
                target = node.target
                if isinstance(iterated, ast.Call) and call_name(iterated) == "enumerate" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                    target = target.elts[1]  # the counter of enumerate() is an int
                tensors |= _names(target)
            elif isinstance(node, ast.Assign) and _tensor_like(node.value, tensors):
                for target in node.targets:
                    tensors |= _names(target)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None and _tensor_like(node.value, tensors):
                tensors |= _names(node.target)
    return tensors


@rule(
    "GO303",
    "host-sync-in-step",
    "host-device sync in the training step",
    "CUDA runs asynchronously: the Python loop normally queues the next steps' kernels while the GPU is still "
    "busy. .item(), .cpu(), .tolist(), .numpy() and printing a tensor need its value on the host, so the CPU "
    "stops and waits until the GPU has finished everything queued; every step then pays the launch latency "
    "and the GPU idles while Python prepares the next step.",
    "Keep running values on the device (total_loss += loss.detach()) and read them every N steps "
    "(if step % 100 == 0: print(total_loss.item() / 100)) or once per epoch.",
)
def host_sync_in_step(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    parents = _parents(tree)
    for loop in _innermost_training_loops(facts):
        tensors = _tensor_names(loop)
        for call in calls(loop):
            if _is_method_call(call, _HOST_SYNCS):
                outer = parents.get(parents.get(call))  # x.cpu().numpy(): report the chain once, at .numpy()
                if isinstance(outer, ast.Call) and outer.func is parents.get(call) and _is_method_call(outer, _HOST_SYNCS):
                    continue
                what = _snippet(call)
            elif call_name(call) == "print" and any(_tensor_like(a, tensors) for a in call.args):
                what = f"{_snippet(call)} (printing a tensor reads it)"
            else:
                continue
            if _modulo_guarded(call, loop, parents):
                continue
            yield Match(call, f"{what} in the training step makes the CPU wait for the GPU every step")


# --- GO304 ----------------------------------------------------------------------------------

_CONV = re.compile(r"(Lazy)?Conv(Transpose)?[123]d|conv(_transpose)?[123]d")


@rule(
    "GO304",
    "cudnn-benchmark-off",
    "CUDA convolutions without torch.backends.cudnn.benchmark = True",
    "cuDNN has several algorithms for each convolution and the fastest depends on the shapes and the GPU. "
    "With benchmark=True it times them on the first call of each input shape and keeps the winner; without "
    "it, a heuristic picks one, often much slower (10-30% of a conv net's step is common).",
    "Set torch.backends.cudnn.benchmark = True once at the start of the script, when input shapes are fixed "
    "(or take a few values); leave it off if every batch has a new shape, and for bit-reproducible runs "
    "(torch.backends.cudnn.deterministic = True).",
)
def cudnn_benchmark_off(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    if not (facts.uses_cuda and facts.has_convs):
        return
    settings = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(call_name(t).endswith("cudnn.benchmark") for t in node.targets)
    ]
    if settings:
        if all(is_constant(node.value, False) for node in settings):  # else set to True, or to a value chosen at run time
            first = min(settings, key=_position)
            yield Match(first, "torch.backends.cudnn.benchmark = False with CUDA convolutions: cuDNN does not pick the fastest algorithm")
        return
    convs = [c for c in calls(tree) if _CONV.fullmatch(call_name(c).split(".")[-1])]
    if convs:  # facts.has_convs also counts calls like convert(): report only a real convolution
        yield Match(min(convs, key=_position))


# --- GO305 ----------------------------------------------------------------------------------

_LOW_DTYPES = ("float16", "bfloat16", "half")


def _low_precision_by_hand(tree: ast.Module) -> bool:
    """``model.half()``, ``.to(torch.bfloat16)``, ``graphopt.optimize(..., precision="bf16")``: low precision without autocast."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _LOW_DTYPES and call_name(node.value) == "torch":
            return True
        if isinstance(node, ast.Call):
            if _is_method_call(node, ("half", "bfloat16")):
                return True
            precision = keyword(node, "precision")
            if isinstance(precision, ast.Constant) and precision.value in ("bf16", "fp16"):
                return True
    return False


@rule(
    "GO305",
    "no-autocast",
    "CUDA training loop in fp32: no torch.autocast",
    "Tensor cores run bf16/fp16 matmuls and convolutions many times faster than fp32, and half-size "
    "activations halve the memory traffic: mixed precision is the biggest single speed lever on Volta and "
    "newer GPUs (often 2-3x per step), and frees memory for larger batches.",
    'Run the forward pass and the loss under `with torch.autocast("cuda", dtype=torch.bfloat16):` (Ampere or '
    "newer; with dtype=torch.float16 also scale the loss with torch.amp.GradScaler), keep backward and "
    'optimizer.step() outside it; for a model graphopt optimizes, graphopt.optimize(model, inputs, precision="bf16").',
)
def no_autocast(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    if not facts.uses_cuda or facts.uses_amp or _low_precision_by_hand(tree):
        return
    for loop in _innermost_training_loops(facts):
        yield Match(loop)


# --- GO306 ----------------------------------------------------------------------------------

_SMALL_BATCH = 16


def _assigned_name(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> str:
    """``train_loader`` for ``train_loader = DataLoader(...)`` or ``self.train_loader = ...``; else ""."""
    parent = parents.get(call)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        return call_name(parent.targets[0]).split(".")[-1]
    if isinstance(parent, ast.AnnAssign):
        return call_name(parent.target).split(".")[-1]
    return ""


@rule(
    "GO306",
    "tiny-batch-steps",
    "tiny batches with an optimizer step every iteration",
    "Each step launches the same kernels, synchronizes the optimizer and updates every parameter whatever "
    "the batch size: with a handful of samples the GPU is mostly idle between launches, the step time is "
    "dominated by fixed overhead, and the gradients are noisy.",
    "Raise batch_size if memory allows; otherwise accumulate gradients over k batches: divide the loss by k, "
    "call backward() every batch and `if (i + 1) % k == 0: optimizer.step(); optimizer.zero_grad()` "
    "(an effective batch of k * batch_size, with the learning rate tuned for that).",
)
def tiny_batch_steps(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    parents = _parents(tree)
    steps = [
        (call, loop) for loop in _innermost_training_loops(facts) for call in calls(loop)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "step"
    ]
    if not steps or any(_modulo_guarded(call, loop, parents) for call, loop in steps):
        return  # no optimizer step in a training loop, or the steps accumulate gradients
    for call in dataloader_calls(tree):
        size = constant_int(loader_setting(call, "batch_size"))
        if size is None or size >= _SMALL_BATCH:
            continue
        if _eval_named(_assigned_name(call, parents)):
            continue  # a validation/test loader: no optimizer steps on it
        yield Match(call, f"batch_size={size} with an optimizer step every iteration: accumulate gradients over several batches")
