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
    text += _row(0, "_w4_wgmma_kernel", "GPU Speed Of Light Throughput", "Memory Throughput", "%", "54.3")
    # the same metric name under another section is another quantity (bytes per second, not % of peak)
    text += _row(0, "_w4_wgmma_kernel", "Memory Workload Analysis", "Memory Throughput", "byte/s", "1,326,014,388,489.21")
    text += _row(0, "_w4_wgmma_kernel", "Scheduler Statistics", "Issued Warp Per Scheduler", "", "0.29")
    text += _row(0, "_w4_wgmma_kernel", "Occupancy", "Achieved Occupancy", "%", "30.2")
    # the counts asked for by name, in ncu's auto-scaled units
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics", "smsp__inst_executed.sum", "Minst", "15.31")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics", "dram__bytes_read.sum", "Mbyte", "33.02")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics", "lts__t_sectors_srcunit_tex_op_read.sum",
                 "Ksector", "1,900")
    text += _row(0, "_w4_wgmma_kernel", "Command line profiler metrics",
                 "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "", "3,522,846")
    # ncu writes a warning line between the rows when a section has nothing to show
    text += "==WARNING== No metrics to show for section(s): MemoryWorkloadAnalysis_Tables.\n"
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
    assert v4b["mem %"] == "54.3" and v4b["DRAM GB/s"] == "1326.0" and v4b["issued/cycle"] == "0.29"
    assert v4b["warp inst (M)"] == "15.3" and v4b["DRAM read MB"] == "33.0" and v4b["L2->L1 MB"] == "60.8"
    assert v4b["shared wavefronts (M)"] == "3.5" and v4b["shared bank conflicts (M)"] == ""
    assert v4b["top stalls (cycles per issued instruction)"] == "wait 9.2, long_scoreboard 3.5"  # the two largest
    assert gemm["us"] == "40.5" and gemm["top stalls (cycles per issued instruction)"] == ""


def test_summary_puts_each_kernel_under_the_target_whose_marker_precedes_it():
    i = ncu_kernels.TARGETS.index("moe-v4b")
    text = HEAD
    text += _row(0, ncu_kernels.MARKER, "GPU Speed Of Light Throughput", "Duration", "usecond", "1.0", grid=f"({i + 1}, 1, 1)")
    text += _row(1, "_moe_wgmma_kernel", "GPU Speed Of Light Throughput", "Duration", "usecond", "171.5")
    text += _row(2, "_moe_wgmma_kernel", "GPU Speed Of Light Throughput", "Duration", "usecond", "77.5")
    text += _row(3, ncu_kernels.MARKER, "GPU Speed Of Light Throughput", "Duration", "usecond", "1.0", grid=f"({i + 2}, 1, 1)")
    text += _row(4, "_matmul_ogs_NNT_bf16xbf16xmxfp4", "GPU Speed Of Light Throughput", "Duration", "usecond", "93.7")
    lines = ncu_kernels.summarize(text).splitlines()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    kernels = [r for r in rows[1:] if r[1] not in ("kernels",) and len(r) > 3]
    assert [(r[0], r[1]) for r in kernels] == [("moe-v4b", "_moe_wgmma_kernel"), ("moe-v4b", "_moe_wgmma_kernel"),
                                               (ncu_kernels.TARGETS[i + 1], "_matmul_ogs_NNT_bf16xbf16xmxfp4")]
    totals = {r[0]: (r[1], r[2]) for r in rows if len(r) == 3 and r[0] != "target"}
    assert totals == {"moe-v4b": ("2", "249.0"), ncu_kernels.TARGETS[i + 1]: ("1", "93.7")}  # markers not counted


def test_summary_refuses_what_is_not_ncu_csv():
    with pytest.raises(ValueError, match="ncu CSV"):
        ncu_kernels.summarize("==ERROR== ERR_NVGPUCTRPERM\n")


def test_every_target_is_named_once_and_unknown_ones_are_refused():
    """Every target a builder makes has one index in TARGETS; the deleted kernels' names keep theirs (the committed
    CSVs' markers) but are no longer targets one can run."""
    names = ncu_kernels.TARGETS
    built = [n for group in ncu_kernels.GROUPS.values() for n in group]
    assert len(built) == len(set(built)) and set(built) <= set(names) and "moe-triton_kernels" in built
    assert len(names) == len(set(names)) and set(names) - set(built) == {"dense-v4b", "moe-v4b"}
    for gone in ("dense-v5", "moe-v4b"):
        with pytest.raises(ValueError, match="unknown targets"):
            ncu_kernels.run([gone])
