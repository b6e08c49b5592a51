"""tools/dev/kernel_report.py's reading of ptxas -v output (no compiler needed)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "kernel_report", Path(__file__).resolve().parent.parent / "tools" / "dev" / "kernel_report.py")
kernel_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_report)

SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for __cuda_sm3x_div_rn_noftz_f32_slowpath
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function '_Z6kernelILi128EEvPf' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelILi128EEvPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compile time = 322.619 ms
ptxas info    : Function properties for __cuda_sm3x_div_rn_noftz_f32_slowpath
    16 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Compiling entry function '_Z5otherv' for 'sm_80'
ptxas info    : Function properties for _Z5otherv
    40 bytes stack frame, 56 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 384 bytes cmem[0]
"""


def test_parse_takes_each_entry_function_and_not_device_functions():
    rows = kernel_report.parse(SAMPLE)
    assert rows == [
        dict(kernel="_Z6kernelILi128EEvPf", target="sm_90a", registers=168, smem=0, stack=0, spill_stores=0,
             spill_loads=0),
        dict(kernel="_Z5otherv", target="sm_80", registers=255, smem=4096, stack=40, spill_stores=56, spill_loads=88),
    ]


def test_short_name_drops_namespace_return_type_and_parameters():
    name = ("void (anonymous namespace)::flash_sm90_fwd<128, 128, __nv_bfloat16, true, 0, false, false, true>"
            "(CUtensorMap_st, CUtensorMap_st, std::conditional<false, (anonymous namespace)::BatchParams, "
            "(anonymous namespace)::Params>::type)")
    assert kernel_report.short_name(name) == "flash_sm90_fwd<128, 128, __nv_bfloat16, true, 0, false, false, true>"
    assert kernel_report.short_name("void softmax_rows(float*, int)") == "softmax_rows"
