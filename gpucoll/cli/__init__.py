"""gpucoll's command-line tools, one module each, run by ``python -m gpucoll <command>`` (gpucoll/__main__.py) and
by the console scripts: explain (the algorithms for one call), info, topo, tune, trace (with trace_merge and
trace_plot). gpucoll-bench, the main job, is the ``gpucoll.bench`` package. Nothing here is imported by the library.
"""
