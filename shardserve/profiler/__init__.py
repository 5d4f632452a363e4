"""Step profiler: runs controlled batches on the real engine, splits each step's wall time into op
classes (GEMM, attention, elementwise, communication, sampling, host overhead), computes MFU and
MBU against the device's peaks, names the bottleneck of prefill and decode, and fits the planner
cost model's efficiency factors to the measured step times (docs/profiling.md).

    sweep.py            which batches to run (SweepPoint, quick and full sweeps)
    controlled_steps.py puts the engine in the state whose next step is a given batch
    step_probe.py       times the phases of engine.step() (schedule, prepare, forward, sample, update)
    op_classes.py       attributes a torch.profiler trace of one step to op classes
    step_measure.py     measures one sweep point: unprofiled repeats plus one profiled step
    roofline.py         FLOPs and bytes per op class, MFU / MBU, bottlenecks
    calibration_fit.py  least-squares fit of the efficiency factors and host overhead terms
    report.py           CSV, the printed table, bottleneck lines
    roofline_plot.py    the roofline PNG
    profile_run.py      the whole run: engine, peaks, sweep, outputs
    cli_args.py         `shardserve profile`
"""
