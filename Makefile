# Every target creates or refreshes .venv first, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Re-install when the project's metadata changes; otherwise the targets start at once. CORE_STAMP: torch and graphopt
# with its core dependencies (all `make demo` needs); STAMP: the test extra on top (tests, benchmarks, notebooks).
CORE_STAMP := $(VENV)/.graphopt-core-installed
STAMP  := $(VENV)/.graphopt-installed
# The CPU build of torch for development and CI; the library itself declares torch>=2.6.
TORCH  := torch==2.13.0

.PHONY: venv torchvision test browser docs-pictures fuzz demo notebooks bench bench-reference bench-transformers bench-generate bench-train bench-deploy bench-gpu clean

venv: $(STAMP)

$(CORE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e .
	touch $(CORE_STAMP)

# optimum-intel, the peer of `make bench-generate` (its tests run in `make test`), without its declared dependencies:
# they include torchvision, whose PyPI build replaces the CPU torch with a multi-GB CUDA one. The ones it uses come
# with the generate-bench extra (in the test extra too).
OPTIMUM_INTEL := optimum-intel==2.2.0

# Order-only: a venv the test extra is already in needs nothing more for `make demo`, and the other way round
# the extra is added to the core install; a change to pyproject.toml refreshes both.
$(STAMP): pyproject.toml | $(CORE_STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps '$(OPTIMUM_INTEL)'
	touch $(STAMP)

# torchvision for your own models (`graphopt bench --models torchvision.models:resnet50`): the CPU build that matches the
# pinned torch, from PyTorch's index. PyPI's build is CUDA's: it pulls a CUDA torch over the CPU one, or fails to load beside it.
torchvision: $(CORE_STAMP)
	$(PY) -m pip install --quiet 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu

# One pytest worker per core, a test file to a worker (its module fixtures are built once); see tests/conftest.py.
test: $(STAMP) browser
	$(PY) -m pytest -n auto --dist loadfile

# Chromium for the drawn diff's screenshot test and for PNG drawings: Debian's package, installed where make runs as
# root with apt-get (a fresh CI machine); elsewhere the test is skipped and says why (apt-get install chromium).
browser:
	@command -v chromium >/dev/null 2>&1 || [ -n "$$GRAPHOPT_BROWSER" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } \
		|| echo "no Chromium (apt-get install chromium): the screenshot test will be skipped"

# The property-based test with 500 random models per preset (make test runs a bounded number).
fuzz: $(STAMP)
	GRAPHOPT_FUZZ_EXAMPLES=500 $(PY) -m pytest tests/test_fuzz.py -p no:cacheprovider

# Only torch and graphopt's own dependencies: not the test extra.
demo: $(CORE_STAMP)
	$(VENV)/bin/graphopt demo

# JupyterLab on notebooks/ (installed into .venv the first time; open the URL it prints).
# Run as root (a container), it adds --allow-root, which Jupyter otherwise demands. JUPYTER_ARGS adds options,
# e.g. JUPYTER_ARGS="--no-browser --ip=0.0.0.0" on a headless machine.
NOTEBOOKS_STAMP := $(VENV)/.graphopt-notebooks-installed

$(NOTEBOOKS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[notebooks]'
	touch $(NOTEBOOKS_STAMP)

notebooks: JUPYTER_ROOT = $(if $(filter 0,$(shell id -u)),--allow-root)
notebooks: $(NOTEBOOKS_STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(JUPYTER_ROOT) $(JUPYTER_ARGS)

# The benchmark's extra dependencies (matplotlib for the plot, psutil for memory and load).
BENCH_STAMP := $(VENV)/.graphopt-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# graphopt against its strongest peers (OpenVINO, torch.compile with Inductor freezing, onnxruntime, eager autocast) on the
# full-size anchor models (ResNet-50, MobileNetV2, EfficientNet-B0, ConvNeXt-Tiny, ViT-B/16), batch 8, on a quiet machine
# (about 40 minutes on 2 cores): prints, per model and precision class, graphopt's default and fastest variant against
# the best peer, with roofline fractions; writes bench-results/bench.{json,md,png}.
# BENCH_ARGS adds options, e.g. BENCH_ARGS="--models resnet50 --rounds 20".
ANCHOR_VARIANTS := eager,eager-amp-cl,graphopt-default,graphopt-low,graphopt-cl-onednn,graphopt-low-cl-onednn,graphopt-tune,graphopt-tune-exact,graphopt-openvino,graphopt-openvino-low,graphopt-ort,graphopt-inductor,graphopt-inductor-low,graphopt-cl-fuse,graphopt-low-cl-graph,compile-freeze-cl,compile-freeze-amp-cl,ort-plain,ort-plain-again,openvino,openvino-f32,openvino-f32-again,graphopt-int8,graphopt-int8-1e-1,graphopt-openvino-int8,graphopt-ort-int8,graphopt-tune-int8,openvino-int8,pt2e-int8
bench: $(BENCH_STAMP)
	$(VENV)/bin/graphopt bench --models anchors --batch 8 --rounds 10 --variants '$(ANCHOR_VARIANTS)' $(BENCH_ARGS)

# Every variant on the small reference models, batch 8: bench-results/reference/bench.{json,md,png}.
bench-reference: $(BENCH_STAMP)
	$(VENV)/bin/graphopt bench --models reference --batch 8 --output-dir bench-results/reference $(BENCH_ARGS)

# BERT-base- and GPT-2-small-sized models (random weights, from configs), batch 8, sequence 128, with an attention mask:
# graphopt against eager, torch.compile and onnxruntime, interleaved (about 10 minutes on 2 cores). BENCH_ARGS: e.g. "--rounds 20".
bench-transformers: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m graphopt.bench.transformers $(BENCH_ARGS)

# Text generation: time to first token and per new token of GPT-2 124M, a small Llama and a Qwen2 (random weights
# from configs, head sharpened), batch 1, 32-token prompt, 32 new tokens, greedy, 5 interleaved rounds: graphopt's
# generate() (default, each engine, tune=True) against transformers eager fp32/bf16, static cache + torch.compile and
# optimum-intel's OVModelForCausalLM f32, bf16 and int8 weights; bench-results/generate/bench.{json,md}.
# BENCH_ARGS: e.g. "--models gpt2 --rounds 10", or "--quick" (tiny models: checks the run, measures nothing).
# It needs the generate-bench extra and optimum-intel (see OPTIMUM_INTEL), not the test extra.
GENERATE_BENCH_STAMP := $(VENV)/.graphopt-generate-bench-installed

$(GENERATE_BENCH_STAMP): pyproject.toml | $(CORE_STAMP)
	$(PY) -m pip install --quiet -e '.[generate-bench]'
	$(PY) -m pip install --quiet --no-deps '$(OPTIMUM_INTEL)'
	touch $(GENERATE_BENCH_STAMP)

bench-generate: $(GENERATE_BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/graphopt bench --generate $(BENCH_ARGS)

# One training step (forward, cross-entropy, backward, SGD, zero_grad) of ResNet-50, MobileNetV2, ViT-B/16 (batch 8)
# and a BERT-base fine-tuning step (batch 8, sequence 128, attention mask): graphopt's training call, default and
# precision="bf16", against eager bf16 autocast (+ channels_last) and torch.compile (fp32, + bf16 autocast),
# interleaved, on a quiet machine. BENCH_ARGS: e.g. "--models resnet50,mobilenet_v2 --rounds 10".
bench-train: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m graphopt.bench.train $(BENCH_ARGS)

# A saved-and-loaded module and an AOTInductor package (graphopt.save / graphopt.package) against the Python module,
# eager and torch.compile (Inductor, freezing) on ResNet-50 and ViT-B/16, batch 8, interleaved (about 10 minutes
# on 2 cores, most of it compiling). BENCH_ARGS: e.g. "--models resnet50 --rounds 20".
bench-deploy: $(BENCH_STAMP)
	$(PY) -m graphopt.bench.deploy $(BENCH_ARGS)

# The same on one CUDA GPU, within 8 minutes: no variant starts after 5 minutes, and the JSON is written after each model.
bench-gpu: $(BENCH_STAMP)
	timeout 470 $(VENV)/bin/graphopt bench --device cuda --models reference --batch 64 --time-budget 5 \
		--output-dir bench-results/gpu $(BENCH_ARGS)

# The pictures in docs/ (README, notebook 02): the drawn diff of the small reference ResNet, taken by headless Chromium.
docs-pictures: $(STAMP) browser
	$(VENV)/bin/graphopt diff graphopt.models:resnet_small --input 8x3x64x64 --no-progress --drawing docs/graph-diff.png > /dev/null

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
