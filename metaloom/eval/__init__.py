"""`metaloom eval`: tasks, sweeps of (problem, strategy) runs to JSON Lines, accuracy-vs-compute
curves, compute-optimal strategy selection, an HTML report, and Ray fan-out.

Rooms: ``tasks/`` (problems, prompts, graders), ``spec.py`` (``NAME@param=v`` strategy specs),
``records.py`` (the JSONL record), ``runner.py`` (runs and resumes a sweep), ``worker.py`` (a
job run in the process that executes it), ``pool.py`` (what each sample of a sampling strategy
cost), ``analysis/`` (curves, intervals, frontier, selection), ``report/`` (the HTML file),
``ray_executor.py`` (Ray: the address, the cluster) and ``ray_fanout.py`` (the driver's loop
over Ray workers).
"""
