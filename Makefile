# One way to build (the native library) and one way to test (`make test`).
PYTHON ?= python3
NVCC ?= nvcc
# sm_80 (Ampere) and sm_90 (Hopper) machine code, plus sm_90 PTX for newer GPUs.
GENCODE ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC,-Wall -Xptxas -warn-spills --expt-relaxed-constexpr

NATIVE_SRC := $(sort $(wildcard native/*.cu native/*.cuh native/*.h))
CU_SRC := $(sort $(wildcard native/*.cu))
# The same hash attn_lt/native.py computes over native/: a library built from other sources is reported stale.
SOURCE_HASH := $(shell cat $(NATIVE_SRC) | sha256sum | cut -c1-16)
LIB := attn_lt/_native/libattn_lt.so

.PHONY: all native install demo test test-gpu bench clean

all: native

native: $(LIB)

$(LIB): $(NATIVE_SRC) Makefile
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(GENCODE) -DATTN_LT_SOURCE_HASH=\"$(SOURCE_HASH)\" -shared -o $@ $(CU_SRC)

# Installs the package (editable) with the `attn-lt` command. CUDA_EXTRA=cu12|cu13 adds the matching cupy.
install: native
	$(PYTHON) -m pip install -e ".$(if $(CUDA_EXTRA),[$(CUDA_EXTRA)])"

# The main job: the hybrid attention call on a long-context shape, checked against PyTorch SDPA.
# Without a GPU it says so and prints the plan it would run.
demo: install
	$(PYTHON) -m attn_lt demo

test: native
	$(PYTHON) -m pytest -q tests

test-gpu: native
	$(PYTHON) -m pytest -q -m gpu tests

bench: native
	$(PYTHON) tools/bench.py run $(BENCH_ARGS)

clean:
	rm -rf attn_lt/_native build *.egg-info
