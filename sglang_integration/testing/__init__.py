"""What a user of the plugin can reuse to test a deployment on a CPU: the model-less daemon.

``python -m sglang_integration.testing.daemon`` (``daemon``): sglang's real daemon serve loop
with the plugin's hooks and a ledger, without a model; with ``--experts`` it serves (and
fingerprints) expert tensors from files in the format ``expert_files`` reads. The harness built
on it for this repository's tests, demo and benchmarks lives in ``scripts/harness`` and is not
shipped.

Import-light on purpose (nothing imported here).
"""
