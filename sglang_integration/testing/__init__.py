"""The test toolkit: what the tests, the demo and the benchmarks run a deployment with, on a CPU.

- ``daemons`` (``python -m sglang_integration.testing.daemons``): model-backed daemons, one per
  EP rank in one gloo group: sglang's own ``WeightCacheDaemon`` building a real model class and
  loading a real checkpoint with sglang's loader (``model_daemon``), the GPU stand-ins in
  ``gpu_stand_ins``, the routed-expert parameters in shared memory (``routed_weights``);
- ``checkpoint`` (``python -m sglang_integration.testing.checkpoint write``): tiny real
  Qwen3-MoE and DeepSeek-V3 checkpoints from seeded weights; ``checkpoint_experts`` judges what
  a slot holds against the checkpoint;
- ``daemon`` (``python -m sglang_integration.testing.daemon``), the synthetic stand-in kept
  where it buys suite time: sglang's real daemon serve loop with the plugin's hooks and a
  ledger, without a model; with ``--experts`` it serves (and fingerprints) expert tensors from
  files in the format ``expert_files`` reads;
- ``daemon_control``: the forkserver that imports sglang once, model-less daemons started and
  stopped, engine-side stand-in processes;
- ``cpu_engine``: engine ranks on gloo running sglang's real EPLB code through the plugin;
- ``shared_experts``: synthetic routed-expert tensors in shared memory whose bytes carry the
  expert's id (the synthetic stand-in for CUDA IPC);
- ``synthetic_load``: skewed expert loads in place of the expert distribution recorder;
- ``daemon_fuzz`` and ``fuzz_requests``: the daemon fuzzer (Hypothesis, a test dependency);
- ``sglang_env``: the environment sglang is imported with on a CPU.

Like alembic's ``testing``, it ships with the plugin so that a user can test a deployment;
nothing outside it imports it. Import-light on purpose (nothing imported here).
"""
