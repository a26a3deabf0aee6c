# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_REPO := demo-runs/repo
DEMO_DURABLE := demo-runs/durable
DIST_REPO := demo-runs/distributed
DIST_REPO_B := demo-runs/distributed-reordered
REPORT := demo-runs/report.html
# Analysis commands exit 1 when they find something (a difference, a straggler), as diff(1) does: the
# demo shows what they find, so 1 is no failure there (2, a command that cannot run, still is).
FOUND := || [ $$? -eq 1 ]

.PHONY: setup demo lint test test-quick test-exhaustive fuzz bench clean

setup: $(STAMP)

# Idempotent: reinstalls only when the dependency lists change. torch is pinned
# by constraints-dev.txt to the CPU wheel (a looser pin would pull CUDA builds);
# DS_BUILD_OPS=0 builds DeepSpeed (a test dependency) without compiling its CUDA ops. torchtitan
# (a test dependency) goes in without its declared dependencies, which conflict with this stack
# (pyproject.toml's test extra says why, and lists what its checkpointer needs).
$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[test,s3,tui,bench]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints-dev.txt torchtitan
	touch $(STAMP)

demo: setup
	rm -rf $(DEMO_REPO) $(DEMO_DURABLE)
	$(BIN)/python examples/demo.py $(DEMO_REPO) --durable $(DEMO_DURABLE) --steps 30 --every 10
	$(BIN)/ckptfmt ls $(DEMO_REPO)
	$(BIN)/ckptfmt ls $(DEMO_DURABLE)
	$(BIN)/ckptfmt show $(DEMO_REPO)/step-000030 --limit 12
	$(BIN)/ckptfmt verify $(DEMO_REPO)
	$(BIN)/ckptfmt diff $(DEMO_REPO)/step-000020 $(DEMO_REPO)/step-000030 $(FOUND)
	rm -rf $(DIST_REPO)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 4 \
		examples/distributed_demo.py $(DIST_REPO) --steps 20 --every 5 --slow-rank 2 --slow-steps 8-10
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		examples/distributed_demo.py $(DIST_REPO) --steps 30 --every 5 --resume
	$(BIN)/ckptfmt ls $(DIST_REPO)
	$(BIN)/ckptfmt verify $(DIST_REPO)
	$(BIN)/ckptfmt stragglers $(DIST_REPO) --min-delay 0.1 $(FOUND)
	$(BIN)/ckptfmt advise $(DIST_REPO) --mtbf 8h
	$(BIN)/ckptfmt gc $(DIST_REPO) --keep-last 2 --dry-run
	rm -rf $(DIST_REPO_B)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 4 \
		examples/distributed_demo.py $(DIST_REPO_B) --steps 20 --every 5 --reorder-from 12
	$(BIN)/ckptfmt compare $(DIST_REPO) $(DIST_REPO_B) $(FOUND)
	$(BIN)/ckptfmt report $(DIST_REPO) --compare $(DIST_REPO_B) --html $(REPORT) --min-delay 0.1
	@echo "the run's report: $(abspath $(REPORT))"

# The linter and the type checker, then every test but the exhaustive ones: what .ci/run calls.
test: lint
	$(BIN)/python -m pytest -q

# ruff over everything and mypy over the core (pyproject.toml says which rules and why).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# The tests that need no torch.distributed ranks, DeepSpeed, S3 server, browser or long run: a few minutes.
test-quick: setup
	$(BIN)/python -m pytest -q -m "not distributed and not deepspeed and not s3 and not browser and not slow and not exhaustive"

# What make test leaves out for time (kill points of single and collective saves, 20 torchrun jobs
# ending cleanly, the S3 variants of some tests, the longest multi-rank runs): .ci/run runs it too.
test-exhaustive: setup
	$(BIN)/python -m pytest -q -m exhaustive

# The whole fuzzing run (make test runs a 200-case subset): 10,000 mutated manifests, commit records
# and markers, each read by every reader; prints failures, outcome counts, time and memory per case.
fuzz: setup
	$(BIN)/python -m tests.support.fuzz_inputs --cases 10000 --seed 1

bench: setup
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) demo-runs .pytest_cache .hypothesis *.egg-info
