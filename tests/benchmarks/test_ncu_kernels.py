"""benchmarks/ncu_kernels.py: the summary of Nsight Compute's CSV (the profiling itself needs a GPU and ncu)."""
import pytest

from benchmarks import ncu_kernels

HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
       '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'


def _row(kid, kernel, section, metric, unit, value, grid="(224, 1, 6)", block="(128, 1, 1)"):
    return f'"{kid}","1","python3","h","{kernel}","1","7","{block}","{grid}","0","9.0","{section}","{metric}","{unit}","{value}"\n'


def test_summary_converts_units_and_ranks_the_stalls():
    text = "==PROF== Connected to process 1\nprofiled dense-v4b\n" + HEAD
    text += _row(0, "_w4_wgmma_kernel", "GPU Speed Of Light Throughput", "Duration", "nsecond", "31,840")
    text += _row(0, "_w4_wgmma_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "25.1")
    text += _row(0, "_w4_wgmma_kernel", "Occupancy", "Achieved Occupancy", "%", "30.2")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics",
                 ncu_kernels.STALL_METRIC.format("long_scoreboard"), "", "3.5")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics", ncu_kernels.STALL_METRIC.format("wait"), "", "9.25")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics", ncu_kernels.STALL_METRIC.format("barrier"), "",
                 "0.5")
    text += _row(1, "nvjet_hsh_gemm", "GPU Speed Of Light Throughput", "Duration", "usecond", "40.45", grid="(112, 1, 1)")
    lines = ncu_kernels.summarize(text, top=2).splitlines()
    assert len(lines) == 4  # header, rule, one row per kernel launch in launch order
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    v4b = dict(zip(cols, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    gemm = dict(zip(cols, (c.strip() for c in lines[3].strip("|").split("|")), strict=True))
    assert v4b["kernel"] == "_w4_wgmma_kernel" and v4b["us"] == "31.8" and v4b["DRAM %"] == "25.1"
    assert v4b["grid"] == "(224, 1, 6)" and v4b["occ %"] == "30.2"
    assert v4b["top stalls (cycles per issued instruction)"] == "wait 9.2, long_scoreboard 3.5"  # the two largest
    assert gemm["us"] == "40.5" and gemm["top stalls (cycles per issued instruction)"] == ""


def test_summary_refuses_what_is_not_ncu_csv():
    with pytest.raises(ValueError, match="ncu CSV"):
        ncu_kernels.summarize("==ERROR== ERR_NVGPUCTRPERM\n")


def test_every_target_is_named_once_and_unknown_ones_are_refused():
    names = [n for group in ncu_kernels.GROUPS.values() for n in group]
    assert len(names) == len(set(names)) and "dense-v4b" in names and "moe-triton_kernels" in names
    with pytest.raises(ValueError, match="unknown targets"):
        ncu_kernels.run(["dense-v5"])
