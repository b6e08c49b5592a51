# One way to build (the native library) and one way to test (`make test`).
PYTHON ?= python3
NVCC ?= nvcc
# sm_80 (Ampere) and sm_90 (Hopper) machine code, plus sm_90 PTX for newer GPUs.
GENCODE ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC,-Wall -Xptxas -warn-spills --expt-relaxed-constexpr
# The build prints exactly these warnings (-warn-spills keeps them visible, so that a new or larger spill shows up);
# each is known and measured, none is a defect:
# * flash.cu, flash_fwd<128, T, 2> (fp16 and bf16, sm_80 and sm_90): 56-64 bytes spill stores, 104-160 bytes spill
#   loads (nvcc 13.0; 124 / 236 with earlier builds). A thread holds two m16 tiles of the 128-wide FP32 output (128
#   registers) plus the score fragments and the folded rows' positions, at the 255-register ceiling (1 CTA of 4
#   warps an SM); the spills go to an L1-resident stack frame. This instantiation runs only D = 128 row blocks of
#   more than 64 rows without a mask, i.e. prefill off Hopper (on Hopper the wgmma kernel takes those); decode,
#   masks and D = 256 use one m16 tile a warp (no spill).
# * flash.cu, flash_fwd<256, T, 1, false> (fp16 and bf16): 16 bytes stores, 16-40 bytes loads. Head dim 256 with
#   64-row blocks (17-64 rows a kv head, or a mask): the 256-wide FP32 output of one m16 tile (128 registers) plus
#   the scores and the mask.
# The softmax kernels have none with nvcc 13.0 (earlier builds spilled 8-16 bytes in the masked PIPE kernel that
# also sums the attention mass).

# wgmma and setmaxnreg exist only in the arch-specific sm_90a target: the Hopper kernels are compiled for it alone
# (an object a file, so the driver cannot pick a plain sm_90 build of them) and linked into the same library.
SM90A_GENCODE ?= -gencode arch=compute_90a,code=sm_90a
SM90A_SRC := native/flash_sm90.cu native/scores_sm90.cu
SM90A_OBJ := $(patsubst native/%.cu,build/native/%.o,$(SM90A_SRC))

NATIVE_SRC := $(sort $(wildcard native/*.cu native/*.cuh native/*.h))
CU_SRC := $(filter-out $(SM90A_SRC),$(sort $(wildcard native/*.cu)))
# The same hash attn_lt/native.py computes over native/: a library built from other sources is reported stale.
SOURCE_HASH := $(shell cat $(NATIVE_SRC) | sha256sum | cut -c1-16)
LIB := attn_lt/_native/libattn_lt.so

.PHONY: all native fastpath install demo test test-deps test-gpu bench clean

all: native

native: $(LIB) fastpath

# The compiled fast path of attention()'s cached fused calls (native/fastpath.cpp), for the installed torch and
# Python; the script skips it, saying so, where no C++ compiler or Python headers are found.
fastpath:
	$(PYTHON) native/build_fastpath.py

build/native/%.o: native/%.cu $(NATIVE_SRC) Makefile
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(SM90A_GENCODE) -c -o $@ $<

$(LIB): $(NATIVE_SRC) $(SM90A_OBJ) Makefile
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(GENCODE) -DATTN_LT_SOURCE_HASH=\"$(SOURCE_HASH)\" -shared -o $@ $(CU_SRC) $(SM90A_OBJ)

# Installs the package (editable) with the `attn-lt` command, then builds the fast path against the torch it
# brought. CUDA_EXTRA=cu12|cu13 adds the matching cupy.
install: $(LIB)
	$(PYTHON) -m pip install -e ".$(if $(CUDA_EXTRA),[$(CUDA_EXTRA)])"
	$(PYTHON) native/build_fastpath.py

# The main job: the hybrid attention call on a long-context shape, checked against PyTorch SDPA.
# Without a GPU it says so and prints the plan it would run.
demo: install
	$(PYTHON) -m attn_lt demo

# pytest is the `test` extra: installed here when missing, so that `make test` works right after `make demo`.
test: native test-deps
	$(PYTHON) -m pytest -q tests

test-deps:
	@$(PYTHON) -c "import pytest" 2>/dev/null || { echo "make test: pytest is missing; installing the test extra"; \
		$(PYTHON) -m pip install -q -e ".[test]"; }

test-gpu: native test-deps
	$(PYTHON) -m pytest -q -m gpu tests

bench: native
	$(PYTHON) tools/bench.py run $(BENCH_ARGS)

clean:
	rm -rf attn_lt/_native build *.egg-info
