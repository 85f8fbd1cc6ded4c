"""A daemon stand-in for the crash test: writes a random stream of moves and reports each step.

Prints ``intent <op> <json>`` before a change and ``ack <op> <json>`` once the ledger call
returned (the point where a daemon would reply ``ok``), flushing each line, until it is killed.
"""

from __future__ import annotations

import json
import random
import sys
import time

from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.retention import Retention

GEOMETRY = Geometry(num_layers=16, num_physical_slots=64, num_logical_experts=48)


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def main() -> None:
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    ledger = Ledger.open(path, Retention(keep_versions=1_000_000, prune_every=1_000_000))
    record = ledger.start_incarnation(
        GEOMETRY, trivial_map(GEOMETRY.num_layers, GEOMETRY.num_physical_slots, 48)
    )
    say("inc", json.dumps(record.incarnation_id))
    record.attach("engine")
    say("ack", "attach", "null")
    while True:
        if record.pending is None:
            layers = sorted(rng.sample(range(GEOMETRY.num_layers), rng.randint(1, 16)))
            say("intent", "begin", json.dumps(layers))
            record.begin("engine", record.version, layers)
            say("ack", "begin", json.dumps(layers))
            continue
        roll = rng.random()
        if roll < 0.8:
            rows = {
                layer: [rng.randrange(48) for _ in range(GEOMETRY.num_physical_slots)]
                for layer in record.pending.layers
            }
            say("intent", "commit", json.dumps(record.version + 1))
            version, digest = record.commit("engine", rows)
            say("ack", "commit", json.dumps([version, digest]))
        elif roll < 0.95:
            say("intent", "abort", "null")
            record.abort("engine")
            say("ack", "abort", "null")
        else:
            say("intent", "detach", "null")
            record.detach("engine")
            say("ack", "detach", "null")
            time.sleep(600)  # dirty: nothing more may move; wait to be killed


if __name__ == "__main__":
    main()
