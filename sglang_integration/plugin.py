"""The SGLang plugin entry point: ``register()`` (setup.cfg, group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` calls ``register()`` early in every engine process (engine.py:286
and :1159, scheduler.py:6323, ...) and then ``HookRegistry.apply_hooks()``. It registers, all
``HookType.AROUND``:

- engine startup: ``ModelRunner.maybe_init_expert_location_metadata`` (``engine_startup``);
- after the weights are loaded: ``ModelRunner.load_model`` (``loaded_content``: every slot holds
  the expert the layout names);
- the IPC loader: ``IpcModelLoader._fetch_from_cache`` and its ``send_msg`` / ``recv_msg``
  bindings (``loader_hooks``);
- rebalancing: ``EPLBManager.rebalance`` (``rebalance``);
- ``spawn_weight_cache_daemon``, so the daemons an engine starts in ``--weight-cache-mode
  daemon`` run with the daemon hooks (``daemon_hooks``).

The daemon process itself never calls ``load_plugins()``; ``python -m sglang_integration.daemon``
and spawned daemons install the daemon hooks with ``daemon_hooks.install_daemon_hooks()``.

Importing this module does nothing: every import and registration happens inside ``register``.
"""

from __future__ import annotations


def register() -> None:
    """Register this package's hooks with sglang's ``HookRegistry`` (applied by sglang)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.engine import ipc_loader as loader_hooks
    from sglang_integration.engine import load_check as loaded_content
    from sglang_integration.engine import rebalance
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
    daemon_hooks.register_spawn_hook()
