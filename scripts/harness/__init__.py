"""The CPU harness of the tests, the demo and the benchmarks (not shipped: it lives in scripts/).

- ``daemon_control``: the forkserver that imports sglang once, model-less daemons started and
  stopped, engine-side stand-in processes;
- ``cpu_engine``: engine ranks on gloo running sglang's real EPLB code through the plugin;
- ``shared_experts``: routed-expert tensors in shared memory (the stand-in for CUDA IPC);
- ``synthetic_load``: skewed expert loads in place of the expert distribution recorder.

Importable as ``harness`` with ``scripts`` on ``sys.path``: pytest puts it there (pyproject's
``pythonpath``), and a script run as ``python scripts/x.py`` has it as ``sys.path[0]``.
Import-light on purpose (nothing imported here): each module imports what it needs.
"""
