"""Training-loop rules GO302-GO306, on small realistic training scripts (linted, never run)."""

from __future__ import annotations

import textwrap

from graphopt import lint
from tests.lint.helpers import found, line


HEADER = """\
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


dataset = TensorDataset(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)))
model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
"""


def script(body: str, header: str = HEADER) -> str:
    return header + textwrap.dedent(body)


# --- GO302 eval-without-no-grad ---------------------------------------------------------------

EVAL_SCRIPT = script(
    """
    train_loader = DataLoader(dataset, batch_size=64, shuffle=True)
    val_loader = DataLoader(dataset, batch_size=256)


    def evaluate(model, loader):
        correct = 0
        for x, y in loader:  # evaluate loop
            out = model(x.to(device))
            correct += (out.argmax(1) == y.to(device)).sum().item()
        return correct / len(loader.dataset)


    for epoch in range(10):
        model.train()
        for x, y in train_loader:  # train loop
            optimizer.zero_grad()
            loss = criterion(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        model.eval()
        val_loss = 0.0
        for x, y in val_loader:  # inline validation loop
            val_loss += criterion(model(x.to(device)), y.to(device))
        print(epoch, val_loss, evaluate(model, val_loader))
    """
)


def test_go302_flags_an_eval_function_and_a_loop_after_model_eval() -> None:
    assert found(EVAL_SCRIPT, "GO302") == [
        ("GO302", line(EVAL_SCRIPT, "# evaluate loop")),
        ("GO302", line(EVAL_SCRIPT, "# inline validation loop")),
    ]
    messages = [f.message for f in lint.check_source(EVAL_SCRIPT, "train.py", select=["GO302"])]
    assert "evaluate()" in messages[0]
    assert f"model.eval() (line {line(EVAL_SCRIPT, 'model.eval()')})" in messages[1]


def test_go302_accepts_no_grad_inference_mode_and_their_decorators() -> None:
    source = EVAL_SCRIPT.replace(
        "def evaluate(model, loader):", "@torch.no_grad()\ndef evaluate(model, loader):"
    ).replace(
        "    for x, y in val_loader:  # inline validation loop\n        val_loss +=",
        "    with torch.inference_mode():\n        for x, y in val_loader:  # inline validation loop\n            val_loss +=",
    )
    assert source != EVAL_SCRIPT and "with torch.inference_mode():" in source
    assert found(source, "GO302") == []


def test_go302_other_ways_to_turn_autograd_off() -> None:
    source = script(
        """
        @torch.inference_mode
        def validate(model, loader):
            return [model(x) for x, in loader]


        def test_epoch(model, loader):
            with torch.set_grad_enabled(False):
                for x, y in loader:
                    model(x)


        def run_val(model, loader):
            for x, y in loader:
                with torch.no_grad():
                    model(x)
        """
    )
    assert found(source, "GO302") == []


def test_go302_names_that_mean_evaluation_and_names_that_do_not() -> None:
    source = script(
        """
        def validate(model, loader):
            for x, y in loader:  # validate
                model(x)


        def testEpoch(model, loader):
            for x, y in loader:  # testEpoch
                model(x)


        def run_val(model, loader):
            for x, y in loader:  # run_val
                model(x)


        def load_latest(paths):
            for path in paths:  # load_latest
                model.load_state_dict(torch.load(path))


        def interval_stats(model, loader):
            for x, y in loader:  # interval_stats
                model(x)
        """
    )
    assert found(source, "GO302") == [
        ("GO302", line(source, "# validate")),
        ("GO302", line(source, "# testEpoch")),
        ("GO302", line(source, "# run_val")),
    ]


def test_go302_ignores_training_loops_loops_after_train_and_loops_that_run_no_model() -> None:
    source = script(
        """
        loader = DataLoader(dataset, batch_size=64)
        metrics = {"accuracy": 0.9}
        model.eval()
        for name, value in metrics.items():  # only builtins and other objects' methods
            print(name, value)
            metrics.update(name=value)
        for x, y in loader:  # fine-tuning loop with backward
            criterion(model(x), y).backward()
            optimizer.step()
        model.train()
        for x, y in loader:  # after model.train()
            model(x)
        with torch.inference_mode(False):
            model.eval()
            for x, y in loader:  # inference_mode(False) does not turn autograd off
                model(x)
        """
    )
    assert found(source, "GO302") == [("GO302", line(source, "# inference_mode(False)"))]


def test_go302_reports_nested_evaluation_loops_once_at_the_outer_loop() -> None:
    source = script(
        """
        def evaluate(model, loaders):
            for loader in loaders:  # outer
                for x, y in loader:  # inner
                    model(x)
        """
    )
    assert found(source, "GO302") == [("GO302", line(source, "# outer"))]


def test_go302_eval_before_the_loop_must_be_in_the_same_function() -> None:
    source = script(
        """
        loader = DataLoader(dataset, batch_size=64)


        def switch(model):
            model.eval()


        def predict(model, loader):
            for x, y in loader:  # a function that did not call eval()
                model(x)


        def infer(model, loader):
            model.eval()
            for x, y in loader:  # after eval() in this function
                model(x)
        """
    )
    assert found(source, "GO302") == [("GO302", line(source, "# after eval() in this function"))]


# --- GO303 host-sync-in-step ------------------------------------------------------------------

SYNC_SCRIPT = script(
    """
    loader = DataLoader(dataset, batch_size=64, shuffle=True)
    for epoch in range(10):
        total = 0
        start = time.time()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            out = model(x)
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()
            total += loss
            losses = loss.item()  # item
            predictions = out.argmax(1).cpu().numpy()  # cpu numpy
            labels = y.tolist()  # tolist
            print(f"epoch {epoch} step {step} took {time.time() - start:.3f}s, {len(labels)} labels")
            print("loss", total)  # print a tensor
            print(f"loss {loss:.3f}")  # f-string of a tensor
            print("shape", out.shape, step)
            if step % 100 == 0:
                print(f"step {step}: {loss.item():.3f}")
                print(loss)
            if loss.item() > 100 and step % 5 == 0:  # in the test
                break
        print(f"epoch {epoch}: {total.item() / len(loader):.3f}")
    """
)


def test_go303_flags_every_sync_in_the_step() -> None:
    assert found(SYNC_SCRIPT, "GO303") == [
        ("GO303", line(SYNC_SCRIPT, "# item")),
        ("GO303", line(SYNC_SCRIPT, "# cpu numpy")),  # the .cpu().numpy() chain once
        ("GO303", line(SYNC_SCRIPT, "# tolist")),
        ("GO303", line(SYNC_SCRIPT, "# print a tensor")),
        ("GO303", line(SYNC_SCRIPT, "# f-string of a tensor")),
        ("GO303", line(SYNC_SCRIPT, "# in the test")),
    ]
    messages = [f.message for f in lint.check_source(SYNC_SCRIPT, "train.py", select=["GO303"])]
    assert messages[0].startswith("loss.item() in the training step")
    assert messages[1].startswith("out.argmax(1).cpu().numpy()")


def test_go303_ignores_guarded_per_epoch_and_evaluation_syncs() -> None:
    source = script(
        """
        loader = DataLoader(dataset, batch_size=64, shuffle=True)
        for epoch in range(10):
            total = torch.zeros((), device=device)
            for step, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = criterion(model(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()
                total += loss.detach()
                if step % 100 == 0:
                    print(f"step {step}: {loss.item():.3f}")
                else:
                    pass
            print(f"epoch {epoch}: {total.item() / len(loader):.3f}")
            model.eval()
            with torch.no_grad():
                correct = sum((model(x.to(device)).argmax(1).cpu() == y).sum().item() for x, y in loader)
                for x, y in loader:
                    print(model(x.to(device)).argmax(1).tolist())
            model.train()
        """
    )
    assert found(source, "GO303") == []


def test_go303_needs_a_training_loop() -> None:
    source = script(
        """
        loader = DataLoader(dataset, batch_size=64)
        with torch.inference_mode():
            for x, y in loader:
                print(model(x.to(device)).argmax(1).cpu().numpy())
        """
    )
    assert found(source, "GO303") == []


# --- GO304 cudnn-benchmark-off ----------------------------------------------------------------

CONV_SCRIPT = script(
    """
    loader = DataLoader(dataset, batch_size=64, shuffle=True)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    """
)


def test_go304_flags_a_cuda_conv_script_once_at_the_first_conv() -> None:
    assert found(CONV_SCRIPT, "GO304") == [("GO304", line(CONV_SCRIPT, "nn.Conv2d(3, 16, 3, padding=1)"))]


def test_go304_accepts_benchmark_true_or_a_run_time_choice() -> None:
    for setting in ("torch.backends.cudnn.benchmark = True", "torch.backends.cudnn.benchmark = not args.variable_shapes"):
        source = CONV_SCRIPT.replace("device = ", f"{setting}\ndevice = ")
        assert setting in source
        assert found(source, "GO304") == []
    source = CONV_SCRIPT.replace("import time\n", "import time\nfrom torch.backends import cudnn\ncudnn.benchmark = True\n")
    assert found(source, "GO304") == []


def test_go304_flags_benchmark_set_to_false() -> None:
    source = CONV_SCRIPT.replace("device = ", "torch.backends.cudnn.benchmark = False\ndevice = ")
    assert found(source, "GO304") == [("GO304", line(source, "benchmark = False"))]


def test_go304_needs_cuda_and_a_convolution() -> None:
    on_cpu = CONV_SCRIPT.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cpu"')
    assert "cuda" not in on_cpu
    assert found(on_cpu, "GO304") == []
    no_conv = CONV_SCRIPT.replace("self.conv = nn.Conv2d(3, 16, 3, padding=1)", "self.conv = nn.Identity()")
    assert found(no_conv, "GO304") == []
    # Facts.has_convs also counts calls named conv*/Conv*: convert() is not a convolution
    converting = no_conv.replace("model = Net().to(device)", "model = convert(Net()).to(device)")
    assert found(converting, "GO304") == []


# --- GO305 no-autocast ------------------------------------------------------------------------

TRAIN_SCRIPT = script(
    """
    loader = DataLoader(dataset, batch_size=64, shuffle=True)


    def train(model, loader):
        for epoch in range(10):
            for x, y in loader:  # step loop
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
    """
)


def test_go305_flags_the_step_loop_of_a_cuda_script_without_autocast() -> None:
    assert found(TRAIN_SCRIPT, "GO305") == [("GO305", line(TRAIN_SCRIPT, "# step loop"))]
    (finding,) = lint.check_source(TRAIN_SCRIPT, "train.py", select=["GO305"])
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in finding.fix
    assert 'precision="bf16"' in finding.fix


def test_go305_accepts_autocast() -> None:
    source = TRAIN_SCRIPT.replace(
        "            loss = criterion(model(x), y)",
        '            with torch.autocast("cuda", dtype=torch.bfloat16):\n                loss = criterion(model(x), y)',
    )
    assert "autocast" in source
    assert found(source, "GO305") == []


def test_go305_accepts_low_precision_by_hand() -> None:
    for change in (
        "model = Net().to(device).half()",
        "model = Net().to(device, torch.bfloat16)",
        'model = graphopt.optimize(Net().to(device), torch.randn(64, 3, 32, 32, device=device), mode="training", precision="bf16")',
    ):
        source = TRAIN_SCRIPT.replace("model = Net().to(device)", change)
        assert change in source
        assert found(source, "GO305") == []


def test_go305_needs_cuda_and_a_training_loop() -> None:
    on_cpu = TRAIN_SCRIPT.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cpu"')
    assert found(on_cpu, "GO305") == []
    inference = TRAIN_SCRIPT.replace("loss.backward()", "pass")
    assert found(inference, "GO305") == []


# --- GO306 tiny-batch-steps -------------------------------------------------------------------

TINY_BATCH_SCRIPT = script(
    """
    train_loader = DataLoader(dataset, batch_size=4, shuffle=True)  # train loader
    val_loader = DataLoader(dataset, batch_size=4)
    test_loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    for epoch in range(10):
        for i, (x, y) in enumerate(train_loader):
            loss = criterion(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """
)


def test_go306_flags_a_tiny_training_loader_with_a_step_every_batch() -> None:
    assert found(TINY_BATCH_SCRIPT, "GO306") == [("GO306", line(TINY_BATCH_SCRIPT, "# train loader"))]
    (finding,) = lint.check_source(TINY_BATCH_SCRIPT, "train.py", select=["GO306"])
    assert "batch_size=4" in finding.message


def test_go306_any_dotted_form_and_a_positional_batch_size() -> None:
    source = TINY_BATCH_SCRIPT.replace(
        "train_loader = DataLoader(dataset, batch_size=4, shuffle=True)",
        "train_loader = torch.utils.data.DataLoader(dataset, 8, shuffle=True)",
    )
    assert found(source, "GO306") == [("GO306", line(source, "# train loader"))]


def test_go306_accepts_gradient_accumulation() -> None:
    source = TINY_BATCH_SCRIPT.replace(
        "        optimizer.step()\n        optimizer.zero_grad()",
        "        if (i + 1) % 8 == 0:\n            optimizer.step()\n            optimizer.zero_grad()",
    )
    assert "% 8" in source
    assert found(source, "GO306") == []


def test_go306_accepts_large_or_computed_batch_sizes_and_scripts_without_steps() -> None:
    for size in ("16", "64", "args.batch_size"):
        source = TINY_BATCH_SCRIPT.replace("batch_size=4, shuffle=True", f"batch_size={size}, shuffle=True")
        assert f"batch_size={size}" in source
        assert found(source, "GO306") == []
    no_step = TINY_BATCH_SCRIPT.replace("        optimizer.step()\n", "")
    assert found(no_step, "GO306") == []
