"""Device and copy rules (GO202-GO204): what they flag, what they leave alone, and their fixes."""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from graphopt.lint import check_source, fix_source

DEVICE_CODES = ["GO202", "GO203", "GO204"]

SCRIPT = textwrap.dedent(
    """\
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    features = np.random.rand(64, 8).astype(np.float32)
    dataset = TensorDataset(torch.tensor(features), torch.randint(0, 2, (64,)))
    train_loader = DataLoader(dataset, batch_size=16, shuffle=True, num_workers=4, pin_memory=True, persistent_workers=True)
    model = nn.Linear(8, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    class_weights = torch.ones(2).to(device)

    for epoch in range(2):
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = nn.functional.cross_entropy(model(inputs), targets, weight=class_weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """
)


def found(source: str, *codes: str) -> list[tuple[str, int, int, bool]]:
    """(code, line, 1-based column, fixable) of each finding."""
    return [(f.code, f.line, f.col + 1, f.fixable) for f in check_source(source, "train.py", select=list(codes))]


def snippet(body: str, head: str = "import numpy as np\nimport torch\n\ndevice = 'cpu'\n") -> str:
    return head + textwrap.dedent(body)


def run(source: str) -> dict[str, Any]:
    """Execute ``source`` (CPU only, seeded) and return its globals."""
    namespace: dict[str, Any] = {}
    torch.manual_seed(0)
    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory=True without an accelerator warns
        exec(compile(source, "train.py", "exec"), namespace)
    return namespace


def test_device_rules_on_a_training_script() -> None:
    assert found(SCRIPT, *DEVICE_CODES) == [
        ("GO202", 8, 25, False),
        ("GO203", 12, 17, True),
        ("GO204", 16, 27, True),
        ("GO204", 16, 46, True),
    ]


# GO202 tensor-from-data


@pytest.mark.parametrize(
    "line",
    [
        "batch = torch.tensor(features)",
        "batch = torch.tensor(features, dtype=torch.float32)",
        "batch = torch.tensor(data=features)",
        "batch = torch.tensor(np.stack([features, features]))",
        "batch = torch.tensor(samples['image'])",
        "batch = torch.tensor(self.features)",
        "batch = torch.tensor(features, requires_grad=True)",
    ],
)
def test_go202_flags_tensor_of_existing_data(line: str) -> None:
    source = snippet(f"features = np.ones((2, 3))\n{line}\n")
    assert found(source, "GO202") == [("GO202", 6, 9, False)]


def test_go202_follows_an_import_alias() -> None:
    source = "import numpy as np\nimport torch as th\n\nfeatures = np.ones(3)\nbatch = th.tensor(features)\n"
    assert found(source, "GO202") == [("GO202", 5, 9, False)]


@pytest.mark.parametrize(
    "line",
    [
        "labels = torch.tensor([1, 2])",
        "scale = torch.tensor(3.0)",
        "shape = torch.tensor((2, 3))",
        "count = torch.tensor(len(features))",
        "total = torch.tensor(float(features.sum()))",
        "value = torch.tensor(features.sum().item())",
        "batch = torch.as_tensor(features)",
        "batch = torch.from_numpy(features)",
        "batch = tf.tensor(features)",
    ],
)
def test_go202_leaves_literals_and_python_values_alone(line: str) -> None:
    assert found(snippet(f"features = np.ones((2, 3))\n{line}\n"), "GO202") == []


def test_go202_is_not_fixed_because_as_tensor_shares_memory() -> None:
    source = snippet(
        """\
        features = np.arange(6, dtype=np.float32).reshape(2, 3)
        batch = torch.tensor(features)
        batch /= 2
        """
    )
    fixed, remaining = fix_source(source, "train.py", select=["GO202"])
    assert fixed == source and [f.code for f in remaining] == ["GO202"]
    # what the rewrite to as_tensor would do: the same tensor, but the in-place op now reaches the array
    before, after = run(source), run(source.replace("torch.tensor(", "torch.as_tensor("))
    assert torch.equal(before["batch"], after["batch"]) and before["batch"].dtype == after["batch"].dtype
    assert before["features"][0, 1] == 1.0 and after["features"][0, 1] == 0.5


# GO203 create-then-move


@pytest.mark.parametrize(
    "line, fixable",
    [
        ("mask = torch.zeros(3, 4).to(device)", True),
        ("mask = torch.ones(3).cuda()", True),
        ("mask = torch.full((2, 2), 7.0).to('cuda:0')", True),
        ("mask = torch.zeros_like(features_t).to(torch.device('cuda'))", True),
        ("mask = torch.eye(3).to(args.device)", True),
        ("mask = torch.tensor(rows).to(device)", True),
        ("mask = torch.randn(3).to(device)", False),  # a CUDA generator draws other numbers
        ("mask = torch.rand_like(features_t).cuda()", False),
        ("mask = torch.arange(seq_len).to(device)", True),  # from 0 in steps of 1: exact anywhere
        ("mask = torch.arange(0, 10, 2).to(device)", True),
        ("mask = torch.arange(0, 1, 0.1).to(device)", False),  # float on CUDA, double on the CPU
        ("mask = torch.arange(start, end).to(device)", False),
        ("mask = torch.linspace(0, 1, 5).to(device)", False),
        ("mask = torch.zeros(3).to(torch.float16)", False),  # a dtype, not a device
        ("mask = torch.zeros(3).to(reference)", False),  # a tensor or a dtype: unknown
        ("mask = torch.zeros(3).to(config.cuda_dtype)", False),
        ("mask = torch.zeros(3).to(device, non_blocking=True)", False),
        ("mask = torch.zeros(3).cuda(1)", False),
        ("mask = torch.zeros(3, device='cpu').to(device)", False),
        ("mask = torch.zeros(3, requires_grad=True).to(device)", False),  # .to() made it a non-leaf
        ("mask = torch.zeros(3, **options).to(device)", False),
    ],
)
def test_go203_flags_tensors_created_then_moved(line: str, fixable: bool) -> None:
    source = snippet(f"rows = [[1, 2]]\n{line}\n")
    assert found(source, "GO203") == [("GO203", 6, 8, fixable)]


@pytest.mark.parametrize(
    "line",
    [
        "mask = torch.zeros(3, 4, device=device)",
        "mask = buffer.to(device)",
        "mask = torch.zeros(3).float()",
        "mask = model.to(device)",
        "mask = np.zeros(3).to(device)",
        "mask = torch.zeros(3)\nmask = mask.to(device)",
    ],
)
def test_go203_leaves_other_moves_alone(line: str) -> None:
    assert found(snippet(f"{line}\n"), "GO203") == []


def test_go203_fix_creates_on_the_device_and_keeps_the_tensors() -> None:
    source = snippet(
        """\
        rows = [[1.5, 2.0], [3.0, 4.5]]
        features_t = torch.arange(6.0).reshape(2, 3)
        a = torch.zeros(3, 4).to(device)
        b = torch.ones(2, dtype=torch.float16).to(device)
        c = torch.full((2, 2), 7).to(device)
        d = torch.arange(0, 10, 3).to(device)
        e = torch.eye(3).to(device)
        f = torch.arange(7).to(device)
        g = torch.tensor(rows).to(device)
        h = torch.ones_like(features_t).to(device)
        i = torch.full_like(features_t, 2.5).to(device)
        """
    )
    fixed, remaining = fix_source(source, "train.py", select=["GO203"])
    assert remaining == []
    assert fixed.splitlines()[6:] == [
        "a = torch.zeros(3, 4, device=device)",
        "b = torch.ones(2, dtype=torch.float16, device=device)",
        "c = torch.full((2, 2), 7, device=device)",
        "d = torch.arange(0, 10, 3, device=device)",
        "e = torch.eye(3, device=device)",
        "f = torch.arange(7, device=device)",
        "g = torch.tensor(rows, device=device)",
        "h = torch.ones_like(features_t, device=device)",
        "i = torch.full_like(features_t, 2.5, device=device)",
    ]
    assert fixed.splitlines()[:6] == source.splitlines()[:6]
    before, after = run(source), run(fixed)
    for name in "abcdefghi":
        assert torch.equal(before[name], after[name]), name
        assert (before[name].dtype, before[name].device) == (after[name].dtype, after[name].device), name
    assert fix_source(fixed, "train.py", select=DEVICE_CODES)[0] == fixed


def test_go203_fix_of_cuda_multi_line_and_aliased_factories() -> None:
    source = "import torch as th\n\nmask = th.ones(3).cuda()\ngrid = th.zeros(\n    8,\n    8,\n).to(local_device)\n"
    fixed, remaining = fix_source(source, "train.py", select=["GO203"])
    assert fixed == 'import torch as th\n\nmask = th.ones(3, device="cuda")\ngrid = th.zeros(\n    8,\n    8,\n device=local_device)\n'
    compile(fixed, "train.py", "exec")
    assert remaining == [] and fix_source(fixed, "train.py", select=DEVICE_CODES)[0] == fixed


def test_go202_and_go203_on_the_same_call() -> None:
    source = snippet("features = np.ones((2, 3))\nbatch = torch.tensor(features).to(device)\n")
    assert found(source, "GO202", "GO203") == [("GO202", 6, 9, False), ("GO203", 6, 9, True)]
    fixed, remaining = fix_source(source, "train.py", select=["GO202", "GO203"])
    assert fixed.splitlines()[-1] == "batch = torch.tensor(features, device=device)"
    assert [f.code for f in remaining] == ["GO202"]
    assert torch.equal(run(source)["batch"], run(fixed)["batch"])


# GO204 blocking-copy


def loop_script(body: str, loader: str = "DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=True)") -> str:
    """A script with a pinned loader (line 6) and a loop whose body (from line 9) is ``body``."""
    return (
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "\n"
        "device = torch.device('cuda')\n"
        "dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))\n"
        f"train_loader = {loader}\n"
        "model = torch.nn.Linear(8, 2).to(device)\n"
        "for step, batch in enumerate(train_loader):\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
    )


@pytest.mark.parametrize(
    "body, expected",
    [
        ("images, labels = batch\nimages = images.to(device)\n", [(10, 14, True)]),
        ("images, labels = batch\nimages = images.cuda()\n", [(10, 14, True)]),
        ("images, labels = batch\nimages = images.to('cuda:0')\n", [(10, 14, True)]),
        ("samples.image = samples.image.to(device, memory_format=torch.channels_last)\n", [(9, 21, True)]),
        ("images = batch[0].to(device)\n", [(9, 14, False)]),  # the fix only touches names and attributes
        ("images = batch.float().cuda()\n", [(9, 14, False)]),
        ("images = batch.to(device, non_blocking=False)\n", [(9, 14, False)]),  # an explicit choice: reported only
        ("images = images.to(device, torch.float16)\n", [(9, 14, True)]),
        ("for x in batch:\n    x = x.to(device)\n", [(10, 13, True)]),
    ],
)
def test_go204_flags_blocking_batch_copies(body: str, expected: list[tuple[int, int, bool]]) -> None:
    assert found(loop_script(body), "GO204") == [("GO204", *where) for where in expected]


@pytest.mark.parametrize(
    "body",
    [
        "images = batch.to(device, non_blocking=True)\n",
        "images = batch.cuda(non_blocking=True)\n",
        "model.to(device)\nnet = model.module.cuda()\n",
        "predictions = batch.to('cpu')\nhost = batch.to(cpu_device)\n",  # device-to-host: must block
        "half = batch.to(torch.float16)\nsame = batch.to(dtype=batch_dtype)\n",
        "images = batch.to(device, False)\nlabels = batch.to(device, torch.int64, False)\n",  # positional non_blocking
    ],
)
def test_go204_leaves_non_blocking_model_host_and_dtype_moves_alone(body: str) -> None:
    assert found(loop_script(body), "GO204") == []


def test_go204_needs_a_pinned_loader_and_a_loader_loop() -> None:
    copy = "images = batch.to(device)\n"
    assert found(loop_script(copy, "DataLoader(dataset, batch_size=16, num_workers=4)"), "GO204") == []
    assert found(loop_script(copy, "DataLoader(dataset, batch_size=16, pin_memory=False)"), "GO204") == []
    assert found(loop_script(copy).replace("enumerate(train_loader)", "range(10)"), "GO204") == []
    outside = loop_script("pass\n") + "sample = dataset[0][0].to(device)\nfirst = sample.to(device)\n"
    assert found(outside, "GO204") == []


def test_go204_fix_adds_non_blocking_only() -> None:
    fixed, remaining = fix_source(SCRIPT, "train.py", select=["GO204"])
    assert fixed == SCRIPT.replace(
        "inputs.to(device), targets.to(device)", "inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)"
    )
    assert remaining == []
    compile(fixed, "train.py", "exec")
    assert fix_source(fixed, "train.py", select=["GO204"])[0] == fixed


def test_go204_fix_on_multi_line_and_trailing_comma_calls() -> None:
    body = "images = images.cuda(\n    0,\n)\nlabels = labels.to(device,)\n"
    fixed, remaining = fix_source(loop_script(body), "train.py", select=["GO204"])
    assert fixed == loop_script("images = images.cuda(\n    0,\n non_blocking=True)\nlabels = labels.to(device, non_blocking=True)\n")
    compile(fixed, "train.py", "exec")
    assert remaining == []


def test_device_fixes_keep_a_cpu_training_run() -> None:
    source = textwrap.dedent(
        """\
        import numpy as np
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        device = "cpu"
        features = np.random.rand(64, 8).astype(np.float32)
        dataset = TensorDataset(torch.as_tensor(features), torch.randint(0, 2, (64,)))
        train_loader = DataLoader(dataset, batch_size=16, shuffle=True, pin_memory=True)
        model = nn.Linear(8, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        class_weights = torch.ones(2).to(device)
        offset = torch.full((2,), 0.5).to(device)

        for epoch in range(2):
            for inputs, targets in train_loader:
                inputs, targets = inputs.to(device), targets.to(device)
                loss = nn.functional.cross_entropy(model(inputs) + offset, targets, weight=class_weights)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """
    )
    fixed, remaining = fix_source(source, "train.py", select=DEVICE_CODES)
    assert remaining == [] and fixed.count("non_blocking=True") == 2 and fixed.count(", device=device)") == 2
    before, after = run(source)["model"], run(fixed)["model"]
    assert torch.equal(before.weight, after.weight) and torch.equal(before.bias, after.bias)
