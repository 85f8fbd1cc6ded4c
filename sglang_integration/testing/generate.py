"""One engine that answers: greedy tokens through sglang's own forward pass on the daemons' weights.

    python -m sglang_integration.testing.generate --model {qwen3_moe,deepseek_v3} \\
        --checkpoint DIR --ep-size N (--dir RUN | --from-disk) [--init-expert-location FILE] \\
        [--rebalances K] [--plugin off] [--role standby] [--prompts FILE] [--new-tokens T] \\
        [--dtype {float32,bfloat16}] [--num-redundant-experts R] [--logits] --out OUT.json

runs one engine of ``N`` EP ranks (``cpu_engine``: each rank sglang's real model, its routed
experts mapped from its daemon ``RUN/rank{R}.sock`` as ``testing.daemons`` makes them, or with
``--from-disk`` every weight from the checkpoint and the weight cache off), greedy-decodes the
prompts (``FILE``: a JSON list of token-id lists; default ``prompts.DEFAULT_PROMPTS``, 8 prompts
of 6 tokens) ``T`` new tokens each (default 32), and with ``K > 0`` runs ``K`` real rebalances
between decode passes: each from sglang's ``EPLBManager.on_forward_pass_end`` at the end of
real forward passes, fed by sglang's expert distribution recorder (the first pass of each over
skewed prompts, ``prompts.load_prompts``, so that every rebalance moves experts: the default
prompts' routing alone asks for the same layout again), two-phase through the daemons as an
engine does with the plugin. It writes ``OUT.json``::

    {"tokens": [[...] per prompt] (the last pass),
     "passes": [{"version": V, "digest": D, "tokens": [...]}, ...],
     "version": V, "digest": D, ...}

``version`` is the version the daemons give the map the engine routed with (null: weights from
disk, or a map no daemon holds, as with ``--plugin off`` after a move); ``digest`` that map's
digest. Also in the file: ``rebalances`` (per rebalance the slots whose expert changed and the
version after it), ``load_skew`` (what the skewed prompts were), and with ``--logits`` each
pass's ``logits`` (per prompt, per step). ``--plugin off`` runs sglang 0.5.23 as it is: no hook
(the bug). ``--role standby`` starts a warm standby (``SGLANG_EXPERT_LAYOUT_ROLE=standby``),
which never rebalances. ``--dtype`` must be the daemons' (``testing.daemons --dtype``; default:
the checkpoint's).

Exit 0 with ``OUT.json`` written; 1 when the engine would fail to start (the reason, as the
plugin gives it, on stderr) or a rank failed; 2 for refused arguments (a prompts file, a dtype
other than the daemons').
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_integration.testing.checkpoint import read_config
from sglang_integration.testing.daemons import DEFAULT_REDUNDANT, add_model_arguments
from sglang_integration.testing.model_daemon import MODEL_DTYPES
from sglang_integration.testing.model_errors import ModelToolkitError
from sglang_integration.testing.prompts import (
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPTS,
    LOAD_HOT_TOKENS,
    LOAD_SEQUENCES,
    LOAD_TOKENS,
    PromptsError,
    read_prompts,
)

MAX_NEW_TOKENS = 64
STANDBY_ENV = (("SGLANG_EXPERT_LAYOUT_ROLE", "standby"),)
# The checkpoint's torch_dtype, as sglang's --dtype names it.
CHECKPOINT_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}


class GenerateError(ModelToolkitError):
    """The engine did not start, or a rank failed: the message says why."""


class DtypeMismatchError(GenerateError):
    """``--dtype`` is not the dtype of the daemons' routed experts."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_integration.testing.generate",
        description="One engine (N EP ranks, sglang's own forward pass on the CPU) greedy-decodes "
        "prompts on model-backed daemons or from disk, with real rebalances between passes.",
    )
    add_model_arguments(parser)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", metavar="RUN", help="the daemons' run directory (testing.daemons)")
    where.add_argument(
        "--from-disk", action="store_true", help="every weight from the checkpoint, no daemon"
    )
    parser.add_argument(
        "--init-expert-location",
        metavar="FILE",
        help='sglang\'s --init-expert-location: a JSON file {"physical_to_logical_map": ...} '
        "(layout-ledger export writes one)",
    )
    parser.add_argument("--rebalances", type=int, default=0, metavar="K")
    parser.add_argument("--plugin", choices=("on", "off"), default="on")
    parser.add_argument("--role", choices=("active", "standby"), default="active")
    parser.add_argument("--prompts", metavar="FILE", help="a JSON list of token-id lists")
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, metavar="T")
    parser.add_argument("--dtype", choices=MODEL_DTYPES, default=None)
    parser.add_argument(
        "--num-redundant-experts",
        type=int,
        default=DEFAULT_REDUNDANT,
        metavar="R",
        help=f"the daemons' --num-redundant-experts (default {DEFAULT_REDUNDANT})",
    )
    parser.add_argument(
        "--layers-per-chunk",
        type=int,
        default=None,
        metavar="L",
        help="sglang's --eplb-rebalance-layers-per-chunk (default: half the MoE layers)",
    )
    parser.add_argument("--logits", action="store_true", help="keep each pass's logits in OUT")
    parser.add_argument("--log-dir", metavar="DIR", help="the ranks' logs (default: a temp dir)")
    parser.add_argument("--out", required=True, metavar="OUT.json")
    args = parser.parse_args(argv)
    if args.ep_size < 2:
        parser.error("--ep-size must be at least 2 (sglang's EPLB needs ep_size > 1)")
    if args.rebalances < 0:
        parser.error("--rebalances must be at least 0")
    if args.role == "standby" and args.rebalances:
        parser.error("a warm standby never rebalances: drop --rebalances or --role standby")
    if args.from_disk and args.role == "standby":
        parser.error("--role standby needs daemons (--dir RUN)")
    if not 1 <= args.new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--new-tokens must be 1 to {MAX_NEW_TOKENS}")
    if args.num_redundant_experts < 0:
        parser.error("--num-redundant-experts must be at least 0")
    return args


def engine_spec(args: argparse.Namespace, log_dir: str) -> Any:
    """The engine's ``cpu_engine.EngineSpec`` for these arguments."""
    from sglang_integration.testing.cpu_engine import EngineSpec, free_port

    checkpoint = str(Path(args.checkpoint).resolve())
    config = read_config(checkpoint)
    moe_layers = _moe_layers(config)
    sockets: tuple[str, ...] = ()
    if args.dir is not None:
        run = Path(args.dir).resolve()
        sockets = tuple(str(run / f"rank{rank}.sock") for rank in range(args.ep_size))
    init = None
    if args.init_expert_location is not None:
        init = str(Path(args.init_expert_location).resolve())
    return EngineSpec(
        name="generate",
        model_dir=checkpoint,
        expert_dir="",
        sockets=sockets,
        port=free_port(),
        num_redundant=args.num_redundant_experts,
        layers_per_chunk=args.layers_per_chunk or max(1, -(-moe_layers // 2)),
        plugin=args.plugin == "on",
        log_dir=log_dir,
        env=STANDBY_ENV if args.role == "standby" else (),
        checkpoint=checkpoint,
        from_disk=args.from_disk,
        ranks=args.ep_size,
        dtype=args.dtype,
        init_expert_location=init,
    )


def _moe_layers(config: dict[str, Any]) -> int:
    layers = int(config.get("num_hidden_layers", 0))
    return max(1, layers - int(config.get("first_k_dense_replace", 0) or 0))


def check_daemons_dtype(args: argparse.Namespace) -> None:
    """``--dtype`` (or the checkpoint's) is the dtype of the daemons' routed experts."""
    from sglang_integration.testing.routed_weights import read_manifest

    if args.dir is None:
        return
    wanted = args.dtype or CHECKPOINT_DTYPES.get(
        str(read_config(args.checkpoint).get("torch_dtype"))
    )
    manifest = read_manifest(Path(args.dir) / "rank0.sock")
    held = {tensor.dtype for tensors in manifest.layers.values() for tensor in tensors}
    floats = held & set(MODEL_DTYPES)
    if wanted is not None and floats and wanted not in floats:
        raise DtypeMismatchError(
            f"the daemons at {args.dir} hold {'/'.join(sorted(floats))} routed experts, this "
            f"engine would compute in {wanted}: pass --dtype {'/'.join(sorted(floats))}"
        )


def run(args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """Start the engine, decode, rebalance between passes; the document ``OUT.json`` holds."""
    from sglang_integration.testing.cpu_engine import CpuEngine

    prompts = (
        [list(p) for p in DEFAULT_PROMPTS]
        if args.prompts is None
        else read_prompts(args.prompts, int(read_config(args.checkpoint)["vocab_size"]))
    )
    check_daemons_dtype(args)
    spec = engine_spec(args, log_dir)
    engine = CpuEngine.launch(spec)
    if engine.failed:
        reasons = sorted({str(failed["error"]) for failed in engine.failed})
        raise GenerateError("the engine did not start: " + " | ".join(reasons))
    try:
        passes = [_pass(engine, prompts, args)]
        rebalances = []
        for _ in range(args.rebalances):
            before = passes[-1]["map"]
            reports = engine.rebalance(1)
            after = reports[0]["map"]
            passes.append(_pass(engine, prompts, args))
            rebalances.append(
                {
                    "moved_slots": sum(
                        a != b
                        for row_a, row_b in zip(before, after, strict=True)
                        for a, b in zip(row_a, row_b, strict=True)
                    ),
                    "version": passes[-1]["version"],
                    "forward_passes": reports[0]["rebalance_passes"][-1],
                }
            )
    finally:
        engine.exit()
    last = passes[-1]
    document: dict[str, Any] = {
        "tokens": last["tokens"],
        "passes": [
            {key: one[key] for key in ("version", "digest", "tokens", "logits") if key in one}
            for one in passes
        ],
        "version": last["version"],
        "digest": last["digest"],
        "model": args.model,
        "ep_size": args.ep_size,
        "dtype": args.dtype,
        "plugin": args.plugin,
        "role": args.role,
        "weights": "disk" if args.from_disk else "daemons",
        "prompts": prompts,
        "new_tokens": args.new_tokens,
        "rebalances": rebalances,
    }
    if rebalances:
        document["load_skew"] = (
            f"before each rebalance, one forward pass over {LOAD_SEQUENCES} prompts of "
            f"{LOAD_TOKENS} tokens drawn from {LOAD_HOT_TOKENS} token ids of that rebalance "
            "(prompts.load_prompts): the default prompts' routing alone would ask for the same "
            "layout again"
        )
    return document


def _pass(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    replies = engine.generate(prompts, args.new_tokens, keep_logits=args.logits)
    tokens = replies[0]["tokens"]
    for reply in replies[1:]:
        if reply["tokens"] != tokens:
            raise GenerateError(
                f"rank {reply['rank']} decoded other tokens than rank 0: the ranks disagree"
            )
    one = {
        "version": replies[0]["routed_version"],
        "digest": replies[0]["routed_digest"],
        "tokens": tokens,
        "map": replies[0]["map"],
    }
    if args.logits:
        one["logits"] = replies[0]["logits"]
    return one


def write_json(path: str | os.PathLike[str], document: Any) -> None:
    """Write ``document`` to ``path`` (a temp file renamed into place)."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    temp.write_text(json.dumps(document, sort_keys=True) + "\n")
    os.replace(temp, target)


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    args = parse_args(argv)
    set_quiet_sglang_env()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="generate-logs-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    from layout_ledger.cli.terminal import printable
    from sglang_integration.testing.cpu_engine import EngineRankError

    try:
        document = run(args, log_dir)
    except (PromptsError, DtypeMismatchError) as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except ModelToolkitError as exc:
        # The plugin's reasons quote what the daemons answered: shown, never obeyed.
        print(f"error: {printable(str(exc))} (the ranks' logs: {log_dir})", file=sys.stderr)
        return 1
    except EngineRankError as exc:  # its message holds the rank's traceback and log tail
        print(f"error: a rank failed: {exc}\n(the ranks' logs: {log_dir})", file=sys.stderr)
        return 1
    write_json(args.out, document)
    version = document["version"]
    print(
        f"wrote {args.out}: {len(document['passes'])} pass(es), "
        f"{len(document['tokens'])} prompts x {args.new_tokens} tokens, version "
        f"{version if version is not None else 'none'}"
        f"{' (weights from disk)' if args.from_disk else ''}, "
        f"digest {document['digest'][:16]}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
