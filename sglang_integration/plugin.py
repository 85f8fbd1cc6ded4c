"""The SGLang plugin entry point: ``register()`` (setup.cfg, group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` calls ``register()`` early in every engine process
(``UPSTREAM_LINES``), then ``HookRegistry.apply_hooks()``. It registers, all ``HookType.AROUND``:
engine startup (``engine.startup``), the check after the weights are loaded
(``engine.load_check``), the IPC loader's fetch (``engine.ipc_loader``), rebalancing
(``engine.rebalance``), a standby's forward passes (``engine.standby``), and
``spawn_weight_cache_daemon``, so that the daemons an engine starts in ``--weight-cache-mode
daemon`` run hooked (``daemon.hooks``). The daemon process itself never loads plugins:
``python -m sglang_integration.daemon`` and spawned daemons install the daemon hooks themselves.

Importing this module does nothing: every import and registration happens inside ``register``.
"""

from __future__ import annotations

from sglang_integration.upstream_lines import UpstreamLine

# Where sglang loads the plugins (tests/test_upstream_lines.py checks the lines).
UPSTREAM_LINES = (
    UpstreamLine("srt/entrypoints/engine.py", 286, "load_plugins()", "Engine.__init__"),
    UpstreamLine(
        "srt/entrypoints/engine.py",
        1159,
        "load_plugins()",
        "before the engine starts its processes",
    ),
    UpstreamLine(
        "srt/managers/scheduler.py", 6323, "load_plugins()", "each scheduler process (a rank)"
    ),
)


def register() -> None:
    """Register this package's hooks with sglang's ``HookRegistry`` (applied by sglang)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.engine import ipc_loader as loader_hooks
    from sglang_integration.engine import load_check as loaded_content
    from sglang_integration.engine import rebalance, standby, standby_follow
    from sglang_integration.engine import startup as engine_startup

    around = HookType.AROUND
    HookRegistry.register(
        engine_startup.HOOK_TARGET,
        engine_startup.around_maybe_init_expert_location_metadata,
        around,
    )
    HookRegistry.register(loaded_content.HOOK_TARGET, loaded_content.around_load_model, around)
    for target, hook in loader_hooks.HOOKS:
        HookRegistry.register(target, hook, around)
    HookRegistry.register(rebalance.HOOK_TARGET, rebalance.rebalance_around, around)
    HookRegistry.register(standby.HOOK_TARGET, standby.around_forward, around)
    if standby_follow.follow_adopted_version not in standby.FOLLOWERS:
        standby.FOLLOWERS.append(standby_follow.follow_adopted_version)
    daemon_hooks.register_spawn_hook()
