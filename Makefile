# One way to build (native/build.py, which `pip install .` runs too) and one way to test (`make test`).
PYTHON ?= python3
PIP_QUIET ?= -q

.PHONY: all native install demo test test-deps test-gpu bench wheel clean

all: native

# The CUDA library and the compiled fast path, in place (attn_lt/_native/), each kept while its sources are
# unchanged. Without nvcc it says so in one line and exits 0: the tests that need the library skip.
native:
	@$(PYTHON) native/build.py

# The package (editable) with the `attn-lt` command. Its build runs native/build.py too, which finds the library
# built first up to date; the second `native` builds the fast path against the torch that pip may have brought.
# CUDA_EXTRA=cu12|cu13 adds the matching cupy.
install: native
	$(PYTHON) -m pip install $(PIP_QUIET) -e ".$(if $(CUDA_EXTRA),[$(CUDA_EXTRA)])"
	@$(PYTHON) native/build.py

# The main job: the hybrid attention call on a long-context shape, checked against PyTorch SDPA.
# Without a GPU it says so and prints the plan it would run.
demo: install
	$(PYTHON) -m attn_lt demo

# pytest is the `test` extra: installed here when missing, so that `make test` works right after `make demo`.
test: native test-deps
	$(PYTHON) -m pytest -q tests

test-deps:
	@$(PYTHON) -c "import pytest" 2>/dev/null || { echo "make test: pytest is missing; installing the test extra"; \
		$(PYTHON) -m pip install $(PIP_QUIET) -e ".[test]"; }

test-gpu: native test-deps
	$(PYTHON) -m pytest -q -m gpu tests

# A wheel with the native parts, for machines with the same CUDA major version and torch (dist/).
wheel:
	$(PYTHON) -m pip wheel $(PIP_QUIET) --no-deps -w dist .

bench: native
	$(PYTHON) tools/bench.py run $(BENCH_ARGS)

clean:
	rm -rf attn_lt/_native build dist *.egg-info
